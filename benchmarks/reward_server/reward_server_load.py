"""Load and memory of ``flowcredit serve-reward``, old code against new, on loopback (docs/rewards.md).

For each checkout given (``--code NAME=PATH``), the script starts that checkout's ``flowcredit
serve-reward`` in a subprocess on a free loopback port, serving :func:`batchable` (sleeps ``--sleep-ms``
per call whatever the batch size, like a GPU model), and measures (the clients: ``reward_server_client.py``)

1. load: ``--clients`` processes each send ``--requests`` one-image requests (64², stdlib http.client,
   one connection each, a new request as soon as the last is answered): wall time, throughput, p50 / p95
   latency, and the server's reward calls where it reports them;
2. memory: the server's peak RSS (VmHWM from /proc) after one request each of 16, 64 and 256 images of
   512² (``--memory-images``), with ``--max-batch 16``. The images are smooth gradients, so bodies are
   small and the growth is what the server keeps decoded.

3. with ``--hostile slow=M,idle=M,failing=M``: the load of 1. again, beside bad clients (slow uploads,
   idle connections, clients whose requests the reward refuses; :class:`Hostile`);
4. with ``--attacks all`` (or some of ``reward_server_attacks.ATTACKS``): a second server at default
   settings, and for each attack of issue 38 the load of 1. beside it: the good clients' throughput,
   p50 / p95, errors, the reward calls, and the server's peak RSS during it (VmHWM, reset before each);
   then one request each of ``reward_server_attacks.probes`` (a 16-bit PNG behind another chunk,
   reward errors holding a path or a lone surrogate, a text/plain body): what comes back.

Everything is bounded: a fixed number of requests, 120 s per request, attacks bounded in connections,
bytes and time, servers killed at the end.

    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/reward_server/reward_server_load.py \\
        --code old=/path/to/old/checkout --code new=.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from reward_server_client import load, peak_rss_mib, post, reward_calls, to_png  # beside this script

HERE = Path(__file__).resolve().parent
SLEEP_S = float(os.environ.get("REWARD_SERVER_LOAD_SLEEP_S", "0.1"))


def batchable(images, prompts, metadata):
    """The served reward: ``SLEEP_S`` per call, whatever the batch size; mean brightness. A prompt
    starting with "reject" is refused (``ValueError``: 422), as a reward refuses bad input; one
    ``fail: TEXT`` raises ``OSError(TEXT)`` (TEXT: a path, say)."""
    time.sleep(SLEEP_S)
    if any(p.startswith("reject") for p in prompts):
        raise ValueError("this reward rejects prompts that start with 'reject'")
    for p in prompts:
        if p.startswith("fail: "):
            raise OSError(p[len("fail: ") :])
    return images.mean(dim=(1, 2, 3))


class Hostile:
    """Bad clients beside the well-behaved ones, in threads of this process, until :meth:`stop`:
    ``slow`` uploads (10 of 1,000 announced body bytes, then one byte a second), ``idle``
    connections (opened once, never sending), and ``failing`` clients (requests the reward refuses,
    back to back)."""

    def __init__(self, port: int, slow: int = 0, idle: int = 0, failing: int = 0):
        self.port, self.done, self.sockets = port, threading.Event(), []
        self.threads = [threading.Thread(target=self._slow, daemon=True) for _ in range(slow)]
        self.threads += [threading.Thread(target=self._failing, daemon=True) for _ in range(failing)]
        for _ in range(idle):
            self.sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        for t in self.threads:
            t.start()

    def _slow(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            conn.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
            while not self.done.wait(1.0):
                try:
                    conn.sendall(b"x")
                except OSError:  # the server gave up on it
                    return

    def _failing(self) -> None:
        body = json.dumps({"images": [to_png(torch.rand(3, 64, 64))], "prompts": ["reject me"]}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        while not self.done.is_set():
            try:
                conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def stop(self) -> None:
        self.done.set()
        for sock in self.sockets:
            sock.close()
        for t in self.threads:
            t.join(timeout=130)


def start(
    code: Path, sleep_ms: float, max_batch: int, timeout: float = 120, defaults: bool = False
) -> tuple[subprocess.Popen, int]:
    """That checkout's ``serve-reward`` in a subprocess (``defaults``: at default settings, else with
    512 MiB bodies, ``max_batch`` and ``timeout``); its pid and port."""
    env = dict(os.environ, PYTHONPATH=f"{code}:{HERE}", OMP_NUM_THREADS="1")
    env["REWARD_SERVER_LOAD_SLEEP_S"] = str(sleep_ms / 1000)
    cmd = [sys.executable, "-m", "flowcredit", "serve-reward", "--reward", "reward_server_load:batchable"]
    cmd += ["--port", "0", "--quiet"]
    if not defaults:
        cmd += ["--max-batch", str(max_batch), "--max-body-mb", "512", "--timeout", str(timeout)]
    log = tempfile.TemporaryFile()  # not a pipe: a server logging more than a pipe holds would block
    proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        log.seek(0)
        raise RuntimeError(f"server from {code} did not start: {line}{log.read()[-2000:]}")
    return proc, int(line.split(" on http://")[1].split()[0].rsplit(":", 1)[1])


def memory(pid: int, port: int, counts: list[int], size: int) -> dict:
    """Peak RSS after one request of each count of ``size``² images (after a one-image warm-up)."""
    ramp = torch.linspace(0, 1, size)
    image = torch.stack([ramp.expand(size, size), ramp.expand(size, size).T, torch.full((size, size), 0.3)])
    png = to_png(image)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    post(conn, json.dumps({"images": [png], "prompts": ["warm-up"]}).encode())
    out = {"after_1": peak_rss_mib(pid)}
    for n in counts:
        body = json.dumps({"images": [png] * n, "prompts": ["a"] * n}).encode()
        assert len(post(conn, body)) == n
        out[f"after_{n}"] = peak_rss_mib(pid)
    out["body_mib_largest"] = round(len(body) / (1 << 20), 2)
    conn.close()
    return out


def main(argv: list[str] | None = None) -> None:
    # imported here: the served process imports this module for batchable alone
    from reward_server_attacks import ATTACKS, attacks, probes  # beside this script

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", action="append", required=True, help="NAME=PATH of a checkout to serve from")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=10, help="per client")
    p.add_argument("--sleep-ms", type=float, default=100.0, help="the reward's time per call")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--memory-images", default="16,64,256")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--server-timeout", type=float, default=120.0, help="the servers' --timeout")
    p.add_argument(
        "--hostile", default="", help="also load beside bad clients, e.g. slow=16,idle=64,failing=1"
    )
    p.add_argument("--attacks", default="", help=f"'all' or some of {','.join(ATTACKS)} (issue 38)")
    p.add_argument("--attack-requests", type=int, default=5, help="per good client, beside each attack")
    args = p.parse_args(argv)
    kinds = list(ATTACKS) if args.attacks == "all" else [k for k in args.attacks.split(",") if k]
    hostile = {k: int(v) for k, v in (kv.split("=") for kv in args.hostile.split(",") if kv)}
    counts = [int(n) for n in args.memory_images.split(",")]
    results = {}
    for spec in args.code:
        name, _, path = spec.partition("=")
        proc, port = start(Path(path).resolve(), args.sleep_ms, args.max_batch, args.server_timeout)
        try:
            row = {"load": load(port, args.clients, args.requests)}
            row["load"]["reward_calls"] = reward_calls(port)
            if hostile:
                bad = Hostile(port, **hostile)
                try:
                    row["load_beside_hostile"] = load(port, args.clients, args.requests)
                finally:
                    bad.stop()
            row["memory_mib"] = memory(proc.pid, port, counts, args.size)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        if kinds:
            proc, port = start(Path(path).resolve(), args.sleep_ms, args.max_batch, defaults=True)
            try:
                print(name, "attacks, at default settings:", flush=True)
                row["attacks"] = attacks(proc, port, kinds, args.clients, args.attack_requests)
                row["probes"] = probes(port)
            finally:
                proc.kill()
                proc.wait(timeout=30)
        results[name] = row
        print(name, json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
