"""Shared by tests/test_reward_server.py and tests/test_reward_client.py: a probe reward, a server
serving it, and raw HTTP helpers."""

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager

import torch

from flowcredit.rewards import REWARDS, get_reward
from flowcredit.rewards.remote import encode_png
from flowcredit.rewards.server import Limits, start_server

TOKEN = "s3cret-token-0123"
LIMITS = Limits(max_body_bytes=1 << 20, max_batch=4, max_wait_ms=20, max_pixels=64 * 64, timeout_s=10)


class Probe:
    """brightness + len(prompt) + metadata["bonus"]; records batch sizes; can fail or sleep on demand."""

    def __init__(self):
        self.batches, self.fail_next, self.sleep = [], [], 0.0
        self.gate: threading.Event | None = None  # when set up, a call waits until the test opens it
        self.entered = threading.Event()  # set by every call
        self.prompts: list[list[str]] = []  # the prompts of every call, in order

    def __call__(self, images, prompts, metadata):
        self.batches.append(len(prompts))
        self.prompts.append(list(prompts))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
        time.sleep(self.sleep)
        if self.fail_next:
            raise self.fail_next.pop(0)
        if any(p.startswith("reject me") for p in prompts):
            raise ValueError("prompt 'reject me' has no quotes")
        bonus = torch.tensor([float(m.get("bonus", 0)) for m in metadata])
        return images.mean(dim=(1, 2, 3)) + torch.tensor([float(len(p)) for p in prompts]) + bonus


def _short_factory():
    return lambda images, prompts, metadata: torch.zeros(1)  # a bug: one score for any batch


@contextmanager
def probe_server():
    """A server on loopback serving ``probe`` (the default), ``jpeg_compressibility`` and a broken
    ``short``; ``.probe`` and ``.port`` on the running server."""
    REWARDS["short"] = _short_factory
    probe = Probe()
    rewards = {"probe": probe, "jpeg_compressibility": get_reward("jpeg_compressibility")}
    rewards["short"] = get_reward("short")
    try:
        with serving(rewards, LIMITS, probe) as running:
            yield running
    finally:
        del REWARDS["short"]


@contextmanager
def serving(rewards: dict, limits: Limits, probe: Probe | None = None):
    """``start_server(rewards)`` with the test token and ``limits``; ``.probe``, ``.port`` and
    ``.service`` (its batchers, for queue checks) on the running server."""
    with start_server(rewards, token=TOKEN, limits=limits) as running:
        running.probe = probe
        running.service = running._server.config.app.state.service
        running.port = int(running.url.rsplit(":", 1)[1])
        yield running


def request(port, method="POST", path="/score", body=None, headers=None, token=TOKEN):
    """One raw request → ``(status, decoded JSON or text)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    hdrs = {"Authorization": f"Bearer {token}"} if token else {}
    hdrs.update(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(raw or b"null")
    except ValueError:
        return resp.status, raw.decode()


def payload(n=3, size=16, prompt="ab"):
    images = torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(n))
    return images, {"images": [encode_png(x) for x in images], "prompts": [prompt] * n, "metadata": [{}] * n}


def expected(images, prompts):
    quantised = images.mul(255).round().div(255)  # what the PNG carries
    return (quantised.mean((1, 2, 3)) + torch.tensor([float(len(p)) for p in prompts])).tolist()


def raw_exchange(port, data: bytes, timeout=10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return s.recv(4096)


def wait_until(condition, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds; the generous timeout only catches a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def send_until_closed(port, data: bytes, timeout=30.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it; a server that keeps it
    open past ``timeout`` raises ``TimeoutError``."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        while chunk := conn.recv(4096):
            answer += chunk
    return answer


# --- a server in a subprocess: its resident memory and its log --------------------------------------


def process_reward(images, prompts, metadata):
    """The reward of :func:`serve_process`: mean brightness; a prompt ``fail: TEXT`` raises an
    exception whose text is TEXT (e.g. a file path)."""
    for prompt in prompts:
        if prompt.startswith("fail: "):
            raise FileNotFoundError(2, "No such file", prompt[len("fail: ") :])
    return images.mean(dim=(1, 2, 3))


@contextmanager
def serve_process(*flags: str):
    """``flowcredit serve-reward --quiet`` serving :func:`process_reward` in a subprocess (with the
    test token); ``.pid``, ``.port`` and ``.log()`` (its stderr so far). Killed on exit."""
    import os
    import select
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=f"{tests.parent}:{tests}", OMP_NUM_THREADS="1")
    env["FLOWCREDIT_REWARD_TOKEN"] = TOKEN
    cmd = [sys.executable, "-m", "flowcredit", "serve-reward", "--reward", "reward_serving:process_reward"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [*cmd, "--port", "0", "--quiet", *flags], env=env, cwd=tests.parent, stdout=subprocess.PIPE,
            stderr=err, text=True,
        )  # fmt: skip
        try:
            ready = select.select([proc.stdout], [], [], 180)[0]  # a hung start fails, not hangs
            line = proc.stdout.readline() if ready else ""
            if " on http://" not in line:
                err.seek(0)
                raise RuntimeError(f"server did not start: {line!r} {err.read()[-2000:]!r}")

            def log() -> str:
                err.seek(0)
                return err.read().decode("utf-8", "replace")

            yield SimpleNamespace(
                pid=proc.pid, port=int(line.split(" on http://")[1].split()[0].rsplit(":", 1)[1]), log=log
            )
        finally:
            proc.kill()
            proc.wait(30)


def memory_kib(pid: int) -> dict[str, int]:
    """``{"VmRSS": …, "VmHWM": …}`` of a process, in KiB (``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        return {
            k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in f) if k in ("VmRSS", "VmHWM")
        }


def reset_peak(pid: int) -> None:
    """Set a process's peak resident memory (VmHWM) to its current one (Linux ≥ 4.0: clear_refs 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
