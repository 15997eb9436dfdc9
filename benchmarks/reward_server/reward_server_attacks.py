"""The attacks of issue 38 on ``flowcredit serve-reward``, for ``reward_server_load.py --attacks``.

Each :class:`Attack` runs from threads of the benchmark's process while the good clients (processes)
load the server; :func:`attacks` measures them beside each, :func:`probes` sends one request each of
the cases that need no load. Everything is bounded in connections, bytes and time.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import subprocess
import threading
import time
from collections import deque

import torch
from reward_server_client import load, peak_rss_mib, reward_calls, to_png  # beside this script

ATTACKS = ("headers", "flood", "slow_max", "reconnecting_failing", "rejected_once", "bodies")


def _reject_body() -> bytes:
    return json.dumps({"images": [to_png(torch.rand(3, 64, 64))], "prompts": ["reject me"]}).encode()


class Attack:
    """One attack of issue 38, from threads of this process until :meth:`stop`:

    - ``headers``: one connection sends a request head of tiny lines without end (reconnecting when
      closed; 48 MiB in all at most);
    - ``flood``: 30 new silent connections a second from 127.0.0.2 (each kept 15 s at most);
    - ``slow_max``: 16 clients announce the largest body, send 10 bytes, and again after each answer;
    - ``reconnecting_failing``: a client sends requests the reward refuses, a new connection each;
    - ``rejected_once``: a client has one request refused, then sends good ones back to back;
    - ``bodies``: 16 clients each send one body of 24 MiB, a string with a single non-BMP character.

    It starts ``warm_s`` before the good clients (a flood fills the server in ~9 s)."""

    WARM_S = {"flood": 10.0, "slow_max": 2.0, "bodies": 0.5}

    def __init__(self, kind: str, port: int, max_body: int):
        self.port, self.max_body, self.done = port, max_body, threading.Event()
        if kind == "bodies":
            self.body = ('{"images": [], "prompts": ["' + "a" * (24 << 20) + '\U0001f600"]}').encode()
        threads = 16 if kind in ("slow_max", "bodies") else 1
        self.threads = [
            threading.Thread(target=getattr(self, "_" + kind), daemon=True) for _ in range(threads)
        ]
        for t in self.threads:
            t.start()
        time.sleep(self.WARM_S.get(kind, 0.5))

    def _connect(self, source: str = "127.0.0.1") -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(source, 0))

    def _headers(self) -> None:
        sent, lines = 0, b"a: b\r\n" * 10_000
        while not self.done.is_set() and sent < 48 << 20:
            try:
                with self._connect() as conn:
                    conn.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
                    while not self.done.is_set() and sent < 48 << 20:
                        conn.sendall(lines)
                        sent += len(lines)
            except OSError:  # closed by the server: again
                time.sleep(0.01)

    def _flood(self) -> None:
        held: deque = deque()
        while not self.done.wait(1 / 30):
            try:
                held.append((time.monotonic(), self._connect("127.0.0.2")))
            except OSError:
                pass
            while held and held[0][0] < time.monotonic() - 15:
                held.popleft()[1].close()
        for _, conn in held:
            conn.close()

    def _slow_max(self) -> None:
        head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {self.max_body}\r\n\r\n".encode()
        while not self.done.is_set():
            try:
                with self._connect() as conn:
                    conn.sendall(head + b"x" * 10)
                    conn.settimeout(0.5)
                    while not self.done.is_set():
                        try:
                            conn.recv(4096)  # the answer (408), or the server closed it
                            break
                        except TimeoutError:
                            continue
            except OSError:
                time.sleep(0.1)

    def _send_all(self, bodies, keep_alive: bool) -> None:
        conn = None
        for body in bodies:
            if self.done.is_set():
                break
            conn = (
                conn
                if keep_alive and conn
                else http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            )
            try:
                conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = None
            if not keep_alive and conn:
                conn.close()

    def _forever(self, body: bytes):
        while not self.done.is_set():
            yield body

    def _reconnecting_failing(self) -> None:
        self._send_all(self._forever(_reject_body()), keep_alive=False)

    def _rejected_once(self) -> None:
        good = json.dumps({"images": [to_png(torch.rand(3, 64, 64))], "prompts": ["once refused"]}).encode()
        self._send_all([_reject_body(), *self._forever(good)], keep_alive=True)

    def _bodies(self) -> None:
        self._send_all([self.body], keep_alive=False)

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=130)


def _png16_behind_a_chunk() -> str:
    """An 8×8 16-bit grey PNG of 128·257 with a tEXt chunk before its IHDR (0.502 grey, or 1.0 clipped)."""
    import io
    import struct
    import zlib

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 128 * 257, dtype=np.uint16)).save(buf, format="PNG")
    text = b"tEXt" + b"k\x00v"
    chunk = struct.pack(">I", 3) + text + struct.pack(">I", zlib.crc32(text))
    return base64.b64encode(buf.getvalue()[:8] + chunk + buf.getvalue()[8:]).decode()


def probes(port: int) -> dict:
    """One request each: a 16-bit PNG behind another chunk, reward errors holding a one-part path or
    a lone surrogate, and a text/plain body; what comes back (status, and the body's first bytes)."""
    cases = {
        "png16_behind_a_chunk": ({"images": [_png16_behind_a_chunk()], "prompts": ["x"]}, "application/json"),
        "error_with_a_path": (
            {"images": [to_png(torch.rand(3, 8, 8))], "prompts": ["fail: /weights.bin"]},
            None,
        ),
        "error_with_a_lone_surrogate": (
            {"images": [to_png(torch.rand(3, 8, 8))], "prompts": ["fail: \ud800"]},
            None,
        ),
        "text_plain_body": ({"images": [to_png(torch.rand(3, 8, 8))], "prompts": ["x"]}, "text/plain"),
    }
    out = {}
    for name, (body, kind) in cases.items():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/score", body=json.dumps(body), headers={"Content-Type": kind} if kind else {})
        response = conn.getresponse()
        out[name] = f"{response.status} {response.read()[:140].decode('utf-8', 'replace')}"
        conn.close()
    return out


def attacks(proc: subprocess.Popen, port: int, kinds: list[str], clients: int, requests: int) -> dict:
    """For each attack: the good clients' load beside it, the reward calls and the server's peak RSS."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    max_body = json.loads(conn.getresponse().read())["max_body_bytes"]
    conn.close()
    out = {}
    for kind in kinds:
        with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        calls, rss = reward_calls(port), peak_rss_mib(proc.pid)
        attack = Attack(kind, port, max_body)
        try:
            row = load(port, clients, requests)
        finally:
            attack.stop()
        row["reward_calls"] = reward_calls(port) - calls
        row["rss_before_mib"], row["peak_rss_mib"] = rss, peak_rss_mib(proc.pid)
        out[kind] = row
        print(f"  {kind}: {json.dumps(row)}", flush=True)
        time.sleep(11)  # the attack's connections close (header_timeout 10 s) before the next one
    return out
