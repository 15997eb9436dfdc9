"""Fixtures shared by test files."""

import sys

import pytest
import torch


def _one_process(tmp_path_factory, name: str, *extra: str):
    from test_multiprocess import TRAIN, _run

    run = tmp_path_factory.mktemp(name) / "one"
    train = ["-m", "flowcredit", "train", "--run_dir", str(run), "--iterations", "2", "--threads", "1"]
    _run([sys.executable, *train, *TRAIN, *extra])
    return run


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """The 1-process run that the DDP runs (test_multiprocess.py) are compared to: 2 iterations of
    their shared tiny config, one thread, the LoRA forward DDP runs too (``auto``: composed)."""
    return _one_process(tmp_path_factory, "one_process")


@pytest.fixture(scope="session")
def one_process_peft_run(tmp_path_factory):
    """The same with peft's LoRA forward, the one a sharded run must use (test_fsdp.py): a comparison
    differs in one thing only, the process count."""
    return _one_process(tmp_path_factory, "one_process_peft", "--lora_forward", "peft")


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


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): the
    tiny diffusers networks are so small that two threads' synchronisation costs more than it saves
    on a shared CPU (measured: 20 ms vs 1.3 s per Qwen-Image velocity call under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
