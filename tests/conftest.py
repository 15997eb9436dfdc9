"""Fixtures shared by test files."""

import sys

import pytest


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """The 1-process run that the 2-process runs (DDP: test_multiprocess.py, FSDP: test_fsdp.py) are
    compared to: 2 iterations of their shared tiny config, one thread."""
    from test_multiprocess import TRAIN, _run

    run = tmp_path_factory.mktemp("one_process") / "one"
    _run(
        [
            sys.executable,
            "-m",
            "flowcredit",
            "train",
            "--run_dir",
            str(run),
            "--iterations",
            "2",
            "--threads",
            "1",
            *TRAIN,
        ]
    )
    return run
