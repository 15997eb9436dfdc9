"""Reward server on loopback: rewards/server.py, app.py, batcher.py, wire.py.

Servers run in a background thread on an ephemeral loopback port. The probes of issue 13 each have a
test (the ``test_probe_*`` ones here and in test_reward_client.py), which the old http.server-based
server and urllib client failed.
"""

import base64
import json
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from reward_serving import TOKEN, Probe, expected, payload, raw_exchange, request, wait_until

from flowcredit.rewards import get_reward
from flowcredit.rewards.server import Limits, start_server

# --- the probes of issue 13 ---------------------------------------------------------------------


def test_probe_oversize_body_gets_its_413(served):
    """A 10.5 MB body against a 1 MiB limit: a clean 413 (the old server reset the connection)."""
    _, port = served
    start = time.monotonic()
    status, data = request(port, path="/score/probe", body=b"x" * 10_500_000)
    assert status == 413 and "max_body_bytes" in data["error"] and time.monotonic() - start < 5
    assert request(port, body=payload(1)[1])[0] == 200


def test_probe_concurrent_requests_share_reward_calls(served):
    """8 clients × 3 one-image requests to a 50 ms reward: fewer calls than requests, own scores back."""
    probe, port = served
    probe.sleep = 0.05

    def client(k):
        out = []
        for j in range(3):
            images, body = payload(1, prompt="x" * (k * 3 + j + 1))
            status, data = request(port, path="/score/probe", body=body)
            out.append((status, data["rewards"], expected(images, body["prompts"])))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(client, range(8)) for r in rs]
    for status, got, want in results:
        assert status == 200 and got == pytest.approx(want)
    assert sum(probe.batches) == 24 and len(probe.batches) < 24 and max(probe.batches) <= 4


def test_probe_deep_json_nesting_is_400(served):
    _, port = served
    status, data = request(port, body=b'{"images": ' + b"[" * 5_000 + b"]" * 5_000 + b"}")
    assert status == 400 and "nested too deeply" in data["error"]
    status, data = request(port, body=b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 413 and "max_json_values" in data["error"]  # counted before parsing
    assert request(port, body=payload(1)[1])[0] == 200


def test_probe_slow_client_hits_the_total_deadline():  # body_timeout_s: test_reward_server_hostile.py
    """One byte every 0.2 s: answered (408) or dropped at the 1 s deadline, not kept waiting for the
    30 s the client would go on (the bound is generous: it separates the two, not fast from slow)."""
    with start_server({"probe": Probe()}, limits=Limits(timeout_s=1.0)) as running:
        port = int(running.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            start, answer = time.monotonic(), b""
            while time.monotonic() - start < 30:
                try:
                    s.sendall(b" ")
                    s.settimeout(0.2)
                    answer = s.recv(4096)
                    break
                except TimeoutError:
                    continue
                except OSError:  # reset: dropped
                    break
            elapsed = time.monotonic() - start
    assert elapsed < 15 and (answer == b"" or answer.startswith(b"HTTP/1.1 408")), (elapsed, answer)


def test_probe_many_half_open_connections_connect_at_once(served):
    """200 idle connections: each connects (the old backlog of 5 made some wait ~1 s for a SYN
    retransmit). Checked without a clock: the listening socket's backlog, as the kernel reports it
    (``ss``: Send-Q of a listening socket), holds all 200, and the server still serves another client.
    (They come from 127.0.0.2: one address may open only max_client_connects_per_s a second.)"""
    _, port = served
    if shutil.which("ss") is None:
        pytest.skip("needs 'ss' (Debian's iproute2) to read the listening socket's backlog")
    listing = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True)
    backlog = int(listing.stdout.split()[2])
    assert backlog >= 200, listing.stdout
    sockets = []
    try:
        for _ in range(200):
            sockets.append(socket.create_connection(("127.0.0.1", port), 30, ("127.0.0.2", 0)))
        assert request(port, body=payload(1)[1])[0] == 200  # and it still serves
    finally:
        for s in sockets:
            s.close()


def test_probe_wrong_number_of_scores_is_500_and_rejected_input_is_422(served):
    probe, port = served
    _, body = payload(2)
    status, data = request(port, path="/score/short", body=body)
    assert status == 500 and "returned 1 values for 2 images" in data["error"]
    _, bad = payload(1, prompt="reject me")
    status, data = request(port, path="/score/probe", body=bad)
    assert status == 422 and "rejected the input: ValueError" in data["error"]
    probe.fail_next = [RuntimeError("boom"), TimeoutError("upstream")]
    status, data = request(port, body=body)
    assert status == 500 and "failed: RuntimeError (error id" in data["error"]
    status, data = request(port, body=body)  # the reward's own timeout is not the request deadline
    assert status == 500 and "failed: TimeoutError" in data["error"]
    assert "no quotes" not in str(data) and "boom" not in str(data) and "upstream" not in data["error"]
    assert request(port, body=body)[0] == 200


def test_probe_duplicate_content_length_is_400(served):
    """A valid request, its Content-Length sent twice (equal, then conflicting): refused."""
    _, port = served
    body = json.dumps(payload(1)[1]).encode()
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
    for second in (len(body), len(body) + 1):
        lengths = f"Content-Length: {len(body)}\r\nContent-Length: {second}\r\n\r\n".encode()
        assert b" 400 " in raw_exchange(port, head + lengths + body).split(b"\r\n")[0]


def test_probe_bearer_scheme_is_case_insensitive(served):
    _, port = served
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert request(port, body=payload(1)[1], headers={"Authorization": f"{scheme} {TOKEN}"})[0] == 200
    assert request(port, body=payload(1)[1], headers={"Authorization": f"Basic {TOKEN}"})[0] == 401


def test_probe_error_bodies_show_no_memory_address_or_token(served):
    _, port = served
    not_an_image = base64.b64encode(b"hello, not an image at all").decode()
    status, data = request(port, body={"images": [not_an_image], "prompts": ["a"]})
    assert status == 400 and "undecodable image" in data["error"]
    assert "0x" not in data["error"] and TOKEN not in data["error"]


# --- batching, several rewards, limits --------------------------------------------------------------


def test_health_advertises_rewards_and_limits(served):
    _, port = served
    status, info = request(port, "GET", "/health", token=None)
    assert status == 200 and info["rewards"] == ["probe", "jpeg_compressibility", "short"]
    assert info["reward"] == "probe" and info["max_body_bytes"] == 1 << 20 and info["max_batch"] == 4
    assert request(port, "GET", "/info", token=None)[1]["max_pixels"] == 64 * 64


def test_rewards_are_addressed_by_name_and_requests_split_by_max_batch(served):
    probe, port = served
    images, body = payload(5)
    status, data = request(port, path="/score/probe", body=body)
    assert status == 200 and data["rewards"] == pytest.approx(expected(images, body["prompts"]))
    assert probe.batches == [4, 1]
    local = get_reward("jpeg_compressibility")(images.mul(255).round().div(255), ["ab"] * 5, [{}] * 5)
    assert request(port, path="/score/jpeg_compressibility", body=body)[1]["rewards"] == local.tolist()
    status, data = request(port, path="/score/nope", body=body)
    assert status == 404 and "served: ['probe'" in data["error"]


def test_a_bad_request_does_not_fail_the_one_it_was_batched_with(server, served):
    """While a first request holds the reward, a good and a bad one queue up and share the next call;
    it fails, so each is scored alone: the good one gets its score, the bad one its 422. The order is
    driven by a gate and the batcher's queue, not by sleeps."""
    probe, port = served
    probe.gate = threading.Event()
    good_images, good = payload(1, prompt="fine")
    _, bad = payload(1, prompt="reject me: a prompt no request has failed with yet")
    queue = lambda: server.service.batchers["probe"]._queue  # noqa: E731
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(request, port, body=payload(1)[1])
        assert probe.entered.wait(60)  # the first call holds the reward
        answers = [pool.submit(request, port, body=b) for b in (good, bad)]
        wait_until(lambda: len(queue()) == 2)
        probe.gate.set()
        assert first.result()[0] == 200
        answers = [a.result() for a in answers]
    probe.gate = None
    assert answers[0] == (200, {"rewards": pytest.approx(expected(good_images, ["fine"]))})
    assert answers[1][0] == 422 and probe.batches == [1, 2, 1, 1]


@pytest.mark.parametrize(
    ("body", "headers", "token", "code"),
    [
        (b"{}", {}, None, 401),
        (b"{}", {}, "wrong-token-0123", 401),
        (b"{not json", {}, TOKEN, 400),
        (b"[1, 2]", {}, TOKEN, 400),
        ({"images": "x", "prompts": []}, {}, TOKEN, 400),
        ({"images": [], "prompts": ["a"]}, {}, TOKEN, 400),
        ({"images": ["!!notbase64"], "prompts": ["a"]}, {}, TOKEN, 400),
        ({"images": [base64.b64encode(b"GIF89a-not-png").decode()], "prompts": ["a"]}, {}, TOKEN, 400),
        ({"images": [], "prompts": [], "extra": 1}, {}, TOKEN, 400),
        (b"x" * 10, {"Content-Length": "abc"}, TOKEN, 400),
        (b"", {"Content-Length": "999999999"}, TOKEN, 413),
    ],
)
def test_error_codes_then_still_serving(served, body, headers, token, code):
    _, port = served
    assert request(port, body=body, headers=headers, token=token)[0] == code
    assert request(port, body=payload(1)[1])[0] == 200


def test_malformed_inputs_oversize_and_truncated_images(served):
    probe, port = served
    _, body = payload(2)
    assert request(port, body={**body, "prompts": ["a"]})[0] == 400
    assert request(port, body={**body, "metadata": [{}, 3]})[0] == 400
    _, big = payload(1, size=80)  # 6400 > max_pixels 4096
    assert (
        request(
            port,
            body={
                **body,
                "images": body["images"] + big["images"],
                "prompts": ["a"] * 3,
                "metadata": [{}] * 3,
            },
        )[0]
        == 413
    )
    _, other = payload(1, size=24)
    mixed = {"images": body["images"][:1] + other["images"], "prompts": ["a", "b"]}
    assert request(port, body=mixed)[0] == 400
    raw = base64.b64decode(payload(1, size=32)[1]["images"][0])
    cut = {"images": [base64.b64encode(raw[: len(raw) // 2]).decode()], "prompts": ["a"]}  # header intact
    status, data = request(port, body=cut)
    assert status == 400 and "undecodable" in data["error"]
    assert probe.batches == []  # nothing was decoded for the reward


def test_missing_content_length_and_chunked_are_refused(served):
    _, port = served
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    no_length = b"POST /score HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
    assert b" 411 " in raw_exchange(port, no_length)[:20]
    chunked = b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n" + auth + b"\r\n0\r\n\r\n"
    assert b" 411 " in raw_exchange(port, chunked)[:20]
