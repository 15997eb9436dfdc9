"""The client side of the ``flowcredit serve-reward`` benchmarks, shared by ``reward_server_load.py``
and ``reward_server_attacks.py``: well-behaved clients loading a server (:func:`load`), one request
(:func:`post`), an image as the wire's PNG (:func:`to_png`), and the server's peak RSS and reward calls.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import statistics
import time

import torch


def to_png(image: torch.Tensor) -> str:
    from flowcredit.rewards.wire import encode_png

    return encode_png(image)


def post(conn: http.client.HTTPConnection, body: bytes) -> list:
    conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
    return json.loads(data)["rewards"]


def _client(port: int, body: bytes, requests: int, ready, results) -> None:
    """One client process: connect, wait for the others, send ``requests`` in turn (a failed one is
    counted, and the next goes on a new connection); latencies of the answered ones, and errors, out."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.connect()
    latencies, errors = [], []
    ready.wait()
    for _ in range(requests):
        t0 = time.perf_counter()
        try:
            post(conn, body)
            latencies.append(time.perf_counter() - t0)
        except Exception as exc:  # reported, not raised: the other clients finish
            errors.append(repr(exc)[:160])
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.close()
    results.put((latencies, errors))


def load(port: int, clients: int, requests: int) -> dict:
    """``clients`` processes (like training ranks; threads would queue on one GIL) × ``requests``
    one-image requests each, one after the other (after one warm-up request): wall time and latencies."""
    warm_up = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        post(
            warm_up, json.dumps({"images": [to_png(torch.rand(3, 64, 64))], "prompts": ["warm-up"]}).encode()
        )
    except (OSError, RuntimeError, http.client.HTTPException) as exc:  # reported with the clients' errors
        warm_up_error = repr(exc)
    else:
        warm_up_error = None
    warm_up.close()
    ctx = multiprocessing.get_context("fork")  # the clients use only http.client
    ready, results = ctx.Barrier(clients + 1), ctx.Queue()
    procs = []
    for k in range(clients):
        body = json.dumps({"images": [to_png(torch.rand(3, 64, 64))], "prompts": [f"client {k}"]}).encode()
        procs.append(ctx.Process(target=_client, args=(port, body, requests, ready, results)))
        procs[-1].start()
    ready.wait()
    t0 = time.perf_counter()
    answers = [results.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for proc in procs:
        proc.join()
    latencies = [t for ts, _ in answers for t in ts]
    errors = [e for _, es in answers for e in es]
    if not latencies:  # every request failed
        return {"requests": 0, "failed": len(errors), "errors": list(dict.fromkeys(errors))[:3]}
    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
    return {
        "requests": len(latencies),
        "failed": len(errors),
        "errors": ([warm_up_error] if warm_up_error else []) + list(dict.fromkeys(errors))[:3],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 2),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p95_ms": round(1000 * q[18], 1),
    }


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return round(next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")) / 1024, 1)


def reward_calls(port: int) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    info = json.loads(conn.getresponse().read())
    conn.close()
    calls = info.get("reward_calls")
    return sum(calls.values()) if isinstance(calls, dict) else None
