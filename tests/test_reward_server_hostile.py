"""The reward server against slow, idle, greedy and broken clients (issue 26): a reward that exits,
file paths in errors, 16-bit PNGs, a failing client in merged calls, a large request ahead of a small
one, slow uploads, idle and half-open connections, JSON of many tiny values. Each test fails on the
server before issue 26. Orderings are driven by the probe's gate and the batcher's queue."""

import base64
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from reward_serving import TOKEN, Probe, payload, request, send_until_closed, serving, wait_until

from flowcredit.rewards.server import Limits


@pytest.mark.parametrize("exc", [SystemExit("bye"), KeyboardInterrupt()])
def test_a_reward_that_exits_is_a_500_and_the_server_goes_on(served, exc):
    probe, port = served
    probe.fail_next = [exc]
    status, data = request(port, body=payload(1)[1])
    assert status == 500 and type(exc).__name__ in data["error"]
    assert request(port, body=payload(1)[1])[0] == 200  # every reward on it still serves


def test_error_bodies_carry_no_file_paths(served):
    probe, port = served
    probe.fail_next = [FileNotFoundError(2, "No such file", "/models/secret-store/pickscore/weights.bin")]
    status, data = request(port, body=payload(1)[1])
    assert status == 500 and "FileNotFoundError" in data["error"] and "(path)" in data["error"]
    assert "secret-store" not in data["error"] and "/models" not in data["error"]


def test_a_16_bit_png_is_refused_not_clipped(served):
    """A 16-bit grey value of 128·257 used to reach the reward as 1.0 (clipped at 255), not 0.502."""
    import io

    import numpy as np
    from PIL import Image

    probe, port = served
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 128 * 257, dtype=np.uint16)).save(buf, format="PNG")
    body = {"images": [base64.b64encode(buf.getvalue()).decode()], "prompts": ["a"]}
    status, data = request(port, body=body)
    assert status == 400 and "8-bit" in data["error"] and probe.batches == []


def test_one_bad_request_costs_log_n_extra_reward_calls():
    """15 good requests and 1 the reward rejects, merged into one call: the failing call is halved
    until the bad one is alone (≤ 2·log2 16 further calls; scoring each request alone took 16)."""
    probe = Probe()
    limits = Limits(max_batch=16, max_wait_ms=20, max_pixels=64 * 64, timeout_s=30, max_concurrency=32)
    with serving({"probe": probe}, limits) as running:
        port, batcher = running.port, running.service.batchers["probe"]
        probe.gate = threading.Event()
        bodies = [payload(1, prompt=f"good {k}")[1] for k in range(15)] + [payload(1, prompt="reject me")[1]]
        with ThreadPoolExecutor(17) as pool:
            first = pool.submit(request, port, body=payload(1)[1])
            assert probe.entered.wait(60)
            answers = [pool.submit(request, port, body=b) for b in bodies]
            wait_until(lambda: len(batcher._queue) == 16)
            probe.gate.set()
            assert first.result()[0] == 200
            codes = [a.result()[0] for a in answers]
    assert codes == [200] * 15 + [422]
    assert probe.batches[1] == 16 and len(probe.batches) - 2 <= 2 * 4, probe.batches


def test_a_small_request_is_not_stuck_behind_a_large_one(server, served):
    """A 64-image request (16 calls of 4) queued before a 1-image one: the small one goes in the
    second call after the reward frees up, not after the large one's sixteen."""
    probe, port = served
    probe.gate = threading.Event()
    batcher = server.service.batchers["probe"]
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(request, port, body=payload(1, prompt="first")[1])
        assert probe.entered.wait(60)
        large = pool.submit(request, port, body=payload(64, size=8, prompt="large")[1])
        wait_until(lambda: len(batcher._queue) == 16)
        small = pool.submit(request, port, body=payload(1, size=8, prompt="small")[1])
        wait_until(lambda: len(batcher._queue) == 17)
        probe.gate.set()
        assert first.result()[0] == 200 and large.result()[0] == 200 and small.result()[0] == 200
    probe.gate = None
    turn = next(k for k, prompts in enumerate(probe.prompts) if "small" in prompts)
    assert turn == 2, [sorted(set(p)) for p in probe.prompts]  # call 0: "first"; call 1: 4 of "large"


def test_slow_uploads_do_not_block_other_clients():
    """More slow uploads than scoring slots (3 clients that send 10 of 1,000 body bytes, 2 slots):
    a well-behaved request is answered at once; it used to wait for a slot until the slow ones' 30 s
    deadline, past the 20 s its client waits."""
    limits = Limits(max_concurrency=2, timeout_s=60, body_timeout_s=30)
    with serving({"probe": Probe()}, limits) as running:
        port = running.port
        head = f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        head += "Content-Length: 1000\r\n\r\n"
        slow = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
        try:
            for s in slow:
                s.sendall(head.encode() + b"x" * 10)
            assert request(port, body=payload(1)[1])[0] == 200  # request() gives up after 20 s
        finally:
            for s in slow:
                s.close()


def test_a_body_that_does_not_arrive_gets_408_at_body_timeout():
    limits = Limits(timeout_s=60, body_timeout_s=1)
    with serving({"probe": Probe()}, limits) as running:
        port = running.port
        head = (
            f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 9\r\n\r\n"
        )
        answer = send_until_closed(port, head.encode() + b"x")  # the 408 closes the connection
    assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout_s=1" in answer, answer


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /sco", b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nx"],
    ids=["nothing", "half a request line", "a body byte after its 401"],
)
def test_idle_and_half_open_connections_are_closed(sent):
    """Connections that never finish a request head are closed at header_timeout_s (they used to stay
    open, and 255 of them filled max_connections)."""
    limits = Limits(header_timeout_s=1)
    with serving({"probe": Probe()}, limits) as running:
        port = running.port
        answer = send_until_closed(port, sent)  # 30 s without the server closing: the test fails
    assert answer == b"" or answer.startswith(b"HTTP/1.1 401"), answer


def test_json_of_many_tiny_values_is_refused_before_it_is_parsed(served):
    """A valid body of 1.5 M floats cost 7.4× its size in Python objects once parsed (more in RSS):
    its values are counted first and it is refused with 413; a body of images parses in ~2× its size."""
    import json
    import tracemalloc

    import torch

    from flowcredit.rewards.wire import ServeError, encode_png, parse_score_request

    _, port = served
    png = encode_png(torch.rand(3, 16, 16))
    tiny = json.dumps({"images": [png], "prompts": ["a"], "metadata": [{"x": [1.5] * 1_500_000}]}).encode()
    tracemalloc.start()
    with pytest.raises(ServeError, match="max_json_values") as refused:
        parse_score_request(tiny, 64 * 64)
    peak_refused = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert refused.value.status == 413 and peak_refused < 0.05 * len(tiny)
    images = json.dumps(
        {"images": [encode_png(torch.rand(3, 64, 64))] * 40, "prompts": ["a, b"] * 40}
    ).encode()
    tracemalloc.start()
    assert len(parse_score_request(images, 64 * 64).pngs) == 40
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2.5 * len(images), peak / len(images)
    small = json.dumps({"images": [png], "prompts": ["a"], "metadata": [{"x": [1.5] * 200_000}]}).encode()
    status, data = request(port, body=small)  # 0.8 MB, under the fixture's 1 MiB body limit
    assert status == 413 and "max_json_values" in data["error"]


def test_a_failing_client_does_not_poison_later_batches(server, served):
    """Once a connection's request has failed the reward alone, its next requests are scored on their
    own: the good requests queued beside it share one call that succeeds (no failing merged call to
    halve, as every batch the bad client joined used to cost)."""
    import http.client
    import json

    probe, port = served
    bad = http.client.HTTPConnection("127.0.0.1", port, timeout=20)  # one keep-alive connection

    def send_bad():
        bad.request("POST", "/score", body=json.dumps(payload(1, prompt="reject me")[1]), headers={
            "Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        response = bad.getresponse()
        response.read()
        return response.status

    assert send_bad() == 422  # scored alone: its connection is now a suspect
    probe.__init__()
    probe.gate = threading.Event()
    batcher = server.service.batchers["probe"]
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(request, port, body=payload(1, prompt="first")[1])
        assert probe.entered.wait(60)
        rejected = pool.submit(send_bad)
        wait_until(lambda: len(batcher._queue) == 1)
        goods = [pool.submit(request, port, body=payload(1, prompt=f"good {k}")[1]) for k in range(3)]
        wait_until(lambda: len(batcher._queue) == 4)
        probe.gate.set()
        assert first.result()[0] == 200 and rejected.result() == 422
        assert [g.result()[0] for g in goods] == [200] * 3
    probe.gate = None
    bad.close()
    calls = [sorted(p) for p in probe.prompts[1:]]
    assert calls == [["reject me"], ["good 0", "good 1", "good 2"]], calls
