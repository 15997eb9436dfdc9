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


@pytest.fixture(scope="module")
def server():
    """A reward server with a probe reward (tests/reward_serving.py), one per test module."""
    from reward_serving import probe_server

    with probe_server() as running:
        yield running


@pytest.fixture
def served(server):
    """The module's server with a fresh probe state: ``(probe, port)``."""
    server.probe.__init__()
    return server.probe, server.port
