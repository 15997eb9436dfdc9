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
        if "reject me" in prompts:
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
