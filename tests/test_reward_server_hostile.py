"""The reward server against slow, idle, greedy and broken clients (issue 26): a reward that exits,
file paths in errors, 16-bit PNGs, a failing client in merged calls, a large request ahead of a small
one, slow uploads, idle and half-open connections, JSON of many tiny values. Each test fails on the
server before issue 26. Then issue 38's: request heads over their bounds, 16-bit PNGs behind other
chunks, reward errors in any form, Content-Type; each fails on the server before issue 38 (but the
one that checks exact conversions). Orderings are driven by the probe's gate and the batcher's queue."""

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
    assert status == 500 and "FileNotFoundError (error id" in data["error"]
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


# --- issue 38: request heads, PNG layouts, error texts, Content-Type ------------------------------


@pytest.mark.parametrize(
    "headers",
    [b"a: b\r\n" * 101, b"X-Long: " + b"v" * 17_000 + b"\r\n"],
    ids=["101 header lines", "a 17 kB header"],
)
def test_a_request_head_over_its_bounds_gets_431_and_is_closed(served, headers):
    """Over max_headers (100) lines or max_header_bytes (16 KiB): 431 and the connection closed (the
    head used to be taken whole, however long: tests/test_reward_server_process.py measures that)."""
    _, port = served
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
    answer = send_until_closed(port, head + headers + b"Content-Length: 2\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 431 ") and b"max_header" in answer, answer[:300]
    assert request(port, body=payload(1)[1])[0] == 200


def _chunk(kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_16_bit_grey(layout: str) -> str:
    """An 8×8 16-bit grey PNG of 128·257, with IHDR first, after another chunk, or after an 8-bit IHDR."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 128 * 257, dtype=np.uint16)).save(buf, format="PNG")
    png = buf.getvalue()
    head, rest = png[:8], png[8:]
    if layout == "a chunk before IHDR":
        rest = _chunk(b"tEXt", b"k\x00v") + rest
    elif layout == "an 8-bit IHDR first":
        rest = _chunk(b"IHDR", bytes.fromhex("00000008 00000008 08 00 00 00 00")) + rest
    return base64.b64encode(head + rest).decode()


@pytest.mark.parametrize("layout", ["a chunk before IHDR", "an 8-bit IHDR first"])
def test_a_16_bit_png_is_refused_whatever_its_chunk_order(served, layout):
    """The bit depth is read from the header PIL decodes by, not from byte 24: a 16-bit image behind
    another chunk or a second IHDR used to reach the reward clipped to 1.0 instead of 0.502."""
    probe, port = served
    status, data = request(port, body={"images": [_png_16_bit_grey(layout)], "prompts": ["a"]})
    assert status == 400 and "8-bit" in data["error"] and probe.batches == []


def test_pngs_converted_exactly_are_decoded():
    """2-bit grey and palette PNGs decode to the 8-bit RGB they mean (grey 85·k; the palette's colours)."""
    import io
    import zlib

    from PIL import Image

    from flowcredit.rewards.wire import decode_pngs

    grey2 = _chunk(b"IHDR", bytes.fromhex("00000004 00000001 02 00 00 00 00"))  # 4×1, 2-bit grey
    pixels = _chunk(b"IDAT", zlib.compress(bytes([0, 0b00011011])))  # filter 0, then grey 0, 1, 2, 3
    png = b"\x89PNG\r\n\x1a\n" + grey2 + pixels + _chunk(b"IEND", b"")
    assert decode_pngs([png])[0, 0, :, 0].tolist() == [0, 85, 170, 255]
    image, buf = Image.new("P", (2, 1)), io.BytesIO()
    image.putpalette([0, 0, 0, 255, 128, 0])
    image.putdata([1, 0])
    image.save(buf, format="PNG")
    assert decode_pngs([buf.getvalue()])[0, 0].tolist() == [[255, 128, 0], [0, 0, 0]]


@pytest.mark.parametrize(
    "text",
    [
        r"\\fileserver\models\pickscore\weights.bin",
        "/weights.bin",
        "/srv/my models/pick score/weights v2.bin",
        "/srv/a=b/c%20d/weights.bin",
        "token=hunter2 at /opt/x",
        "lone surrogate \ud800 here",
    ],
)
def test_error_bodies_name_the_exception_type_never_its_text(served, text):
    """A reward's exception is answered with its type and an error id, never its text (one-part, UNC
    and spaced paths used to show), as valid JSON (a lone surrogate used to make a plain-text 500)."""
    probe, port = served
    probe.fail_next = [OSError(text)]
    status, data = request(port, body=payload(1)[1])
    assert status == 500 and isinstance(data, dict), data
    assert "failed: OSError (error id " in data["error"] and "weights" not in data["error"]
    assert not any(part in data["error"] for part in ("fileserver", "hunter2", "/opt", "surrogate")), data


def test_a_body_that_is_not_json_by_its_content_type_is_415(served):
    """Content-Type must be application/json (with any parameters) or absent; it used to be ignored."""
    _, port = served
    body = payload(1)[1]
    assert request(port, body=body, headers={"Content-Type": "text/plain"})[0] == 415
    for ok in ("application/json", "Application/JSON; charset=utf-8"):
        assert request(port, body=body, headers={"Content-Type": ok})[0] == 200


def test_prompts_and_metadata_round_trip_exactly_with_the_images_taken_out():
    """Images are taken out of the body before the rest is parsed (so that only the rest, bounded by
    max_text_bytes, can widen to 4 bytes a character): long base64 text in prompts and metadata, keys
    included, and escaped quotes before it still parse to exactly what was sent."""
    import json
    import os

    import torch

    from flowcredit.rewards.wire import ServeError, encode_png, parse_score_request

    png, b64 = encode_png(torch.rand(3, 8, 8)), base64.b64encode(os.urandom(90)).decode()
    prompts = ['say \\"' + b64 + '"', b64 + "\U0001f600"]
    metadata = [{b64: [b64, {"q": 'x\\"' + b64}]}, {"k": "\\\\"}]
    body = json.dumps({"images": [png, png], "prompts": prompts, "metadata": metadata}).encode()
    parsed = parse_score_request(body, 64 * 64)
    assert (parsed.prompts, parsed.metadata, len(parsed.pngs)) == (prompts, metadata, 2)
    with pytest.raises(ServeError, match="max_text_bytes") as over:
        parse_score_request(
            json.dumps({"images": [png], "prompts": ["é" * 600]}).encode(), 64 * 64, max_text=1000
        )
    assert over.value.status == 413
