"""Reward server and ``remote`` client on loopback: rewards/server.py, app.py, batcher.py, remote.py.

Servers run in a background thread on an ephemeral loopback port. The probes of issue 13 each have a
test here (the ``test_probe_*`` ones), which the old http.server-based server failed.
"""

import base64
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flowcredit.rewards import REWARDS, get_reward
from flowcredit.rewards.remote import RemoteRewardError, encode_png
from flowcredit.rewards.server import Limits, main, start_server

TOKEN = "s3cret-token-0123"
LIMITS = Limits(max_body_bytes=1 << 20, max_batch=4, max_wait_ms=20, max_pixels=64 * 64, timeout_s=10)


class Probe:
    """brightness + len(prompt) + metadata["bonus"]; records batch sizes; can fail or sleep on demand."""

    def __init__(self):
        self.batches, self.fail_next, self.sleep = [], [], 0.0

    def __call__(self, images, prompts, metadata):
        self.batches.append(len(prompts))
        time.sleep(self.sleep)
        if self.fail_next:
            raise self.fail_next.pop(0)
        if "reject me" in prompts:
            raise ValueError("prompt 'reject me' has no quotes")
        bonus = torch.tensor([float(m.get("bonus", 0)) for m in metadata])
        return images.mean(dim=(1, 2, 3)) + torch.tensor([float(len(p)) for p in prompts]) + bonus


def _short_factory():
    return lambda images, prompts, metadata: torch.zeros(1)  # a bug: one score for any batch


@pytest.fixture(scope="module")
def server():
    """One server for the module: ``probe`` (default), ``jpeg_compressibility`` and a broken ``short``."""
    REWARDS["short"] = _short_factory
    probe = Probe()
    rewards = {"probe": probe, "jpeg_compressibility": get_reward("jpeg_compressibility")}
    rewards["short"] = get_reward("short")
    with start_server(rewards, token=TOKEN, limits=LIMITS) as running:
        running.probe = probe
        running.port = int(running.url.rsplit(":", 1)[1])
        yield running
    del REWARDS["short"]


@pytest.fixture
def served(server):
    """The module's server with a fresh probe state: ``(probe, port)``."""
    server.probe.__init__()
    return server.probe, server.port


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


# --- the probes of issue 13 ---------------------------------------------------------------------


def test_probe_oversize_body_gets_its_413(served):
    """A 10.5 MB body against a 1 MiB limit: a clean 413 (the old server reset the connection)."""
    _, port = served
    start = time.monotonic()
    status, data = request(port, path="/score/probe", body=b"x" * 10_500_000)
    assert status == 413 and "max_body_bytes" in data["error"] and time.monotonic() - start < 5
    assert request(port, body=payload(1)[1])[0] == 200


def test_probe_client_sends_a_batch_larger_than_the_body_limit():
    """24 images over a 20 kB body limit: the client chunks by /health's limits, 4 images a call."""
    probe = Probe()
    with start_server({"probe": probe}, limits=Limits(max_body_bytes=20_000, max_batch=4)) as running:
        remote = get_reward("remote", {"remote": {"url": running.url}})
        images = torch.rand(24, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        prompts = [f"p{i}" * (i % 3 + 1) for i in range(24)]
        got = remote(images, prompts, [{} for _ in prompts])
    assert got.tolist() == pytest.approx(expected(images, prompts))
    assert sum(probe.batches) == 24 and max(probe.batches) <= 4


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
    status, data = request(port, body=b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400 and "nested too deeply" in data["error"]
    assert request(port, body=payload(1)[1])[0] == 200


def test_probe_slow_client_hits_the_total_deadline():
    """One byte every 0.2 s: answered (408) or dropped at the 1 s deadline, not kept waiting."""
    with start_server({"probe": Probe()}, limits=Limits(timeout_s=1.0)) as running:
        port = int(running.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            start, answer = time.monotonic(), b""
            while time.monotonic() - start < 4:
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
    assert elapsed < 2.5 and (answer == b"" or answer.startswith(b"HTTP/1.1 408")), (elapsed, answer)


def test_probe_many_half_open_connections_connect_at_once(served):
    """200 idle connections: each connects at once (the old backlog of 5 made some wait ~1 s)."""
    _, port = served
    sockets, slowest = [], 0.0
    try:
        for _ in range(200):
            start = time.monotonic()
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            slowest = max(slowest, time.monotonic() - start)
        assert request(port, body=payload(1)[1])[0] == 200  # and it still serves
    finally:
        for s in sockets:
            s.close()
    assert slowest < 0.5


def test_probe_wrong_number_of_scores_is_500_and_rejected_input_is_422(served):
    probe, port = served
    _, body = payload(2)
    status, data = request(port, path="/score/short", body=body)
    assert status == 500 and "returned 1 values for 2 images" in data["error"]
    _, bad = payload(1, prompt="reject me")
    status, data = request(port, path="/score/probe", body=bad)
    assert status == 422 and "rejected the input" in data["error"] and "no quotes" in data["error"]
    probe.fail_next = [RuntimeError("boom"), TimeoutError("upstream")]
    status, data = request(port, body=body)
    assert status == 500 and "RuntimeError: boom" in data["error"]
    status, data = request(port, body=body)  # the reward's own timeout is not the request deadline
    assert status == 500 and "TimeoutError: upstream" in data["error"]
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


def test_a_bad_request_does_not_fail_the_one_it_was_batched_with(served):
    """While a first request holds the reward, a good and a bad one queue up and share the next call;
    it fails, so each is scored alone: the good one gets its score, the bad one its 422."""
    probe, port = served
    probe.sleep = 0.2
    good_images, good = payload(1, prompt="fine")
    _, bad = payload(1, prompt="reject me")
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(request, port, body=payload(1)[1])
        time.sleep(0.1)
        answers = list(pool.map(lambda b: request(port, body=b), [good, bad]))
        assert first.result()[0] == 200
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


# --- the client -----------------------------------------------------------------------------------


def test_round_trip_matches_local_reward(server):
    remote = get_reward(
        "remote", {"remote": {"url": server.url, "token": TOKEN, "reward": "jpeg_compressibility"}}
    )
    images = torch.rand(3, 3, 24, 24, generator=torch.Generator().manual_seed(2))
    got = remote(images, ["a", "b", "c"], [{"k": 1}, {}, {}])
    local = get_reward("jpeg_compressibility")
    assert torch.equal(got, local(images.mul(255).round().div(255), ["a", "b", "c"], [{}, {}, {}]))


def test_client_retries_5xx_then_succeeds_and_sends_metadata(served, server):
    probe, _ = served
    probe.fail_next = [RuntimeError("transient"), RuntimeError("transient")]
    remote = get_reward("remote", {"remote": {"url": server.url + "/", "token": TOKEN, "backoff": 0.01}})
    assert remote(torch.zeros(1, 3, 8, 8), ["abc"], [{"bonus": 10}]).tolist() == [13.0]
    assert probe.batches == [1, 1, 1]


def test_client_does_not_retry_4xx(served, server):
    probe, _ = served
    remote = get_reward("remote", {"remote": {"url": server.url, "token": "bad-token-0123", "backoff": 5}})
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"{server.url}/score refused the request: HTTP 401"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])
    assert time.monotonic() - start < 2.0 and probe.batches == []
    unknown = get_reward("remote", {"remote": {"url": server.url, "token": TOKEN, "reward": "nope"}})
    with pytest.raises(RemoteRewardError, match=r"serves \['probe'.*not reward 'nope'"):
        unknown(torch.zeros(1, 3, 8, 8), ["a"], [{}])


def test_client_names_url_after_last_try():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = get_reward(
        "remote", {"remote": {"url": f"http://127.0.0.1:{port}", "retries": 2, "backoff": 0.01}}
    )
    with pytest.raises(RemoteRewardError, match=rf"127.0.0.1:{port}/health failed after 3 tries.*Connect"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])


def test_probe_client_total_time_is_bounded():
    """A server that accepts and never answers: the call fails at its 1 s total timeout, not after
    (retries + 1) × timeout plus backoff as before."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        remote = get_reward("remote", {"remote": {"url": url, "timeout": 1.0, "retries": 3, "backoff": 0.5}})
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=rf"{url}/health.*within timeout=1.0s"):
            remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])
        assert time.monotonic() - start < 1.6


def test_client_rejects_non_json_metadata_and_bad_options():
    remote = get_reward("remote", {"remote": {"url": "http://127.0.0.1:9"}})
    with pytest.raises(ValueError, match="metadata must be plain JSON"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{"x": object()}])
    with pytest.raises(ValueError, match="'url'"):
        get_reward("remote", {"remote": {"url": "file:///etc/passwd"}})
    with pytest.raises(ValueError, match="in_flight"):
        get_reward("remote", {"remote": {"url": "http://127.0.0.1:9", "in_flight": 0}})


def test_png_encoding_is_exact_for_8bit_images():
    import numpy as np
    from PIL import Image

    x = torch.randint(0, 256, (3, 5, 7)).float() / 255
    arr = torch.from_numpy(np.array(Image.open(io.BytesIO(base64.b64decode(encode_png(x))))))
    assert torch.equal(arr.permute(2, 0, 1).float() / 255, x)


# --- the command line -----------------------------------------------------------------------------


def test_main_refuses_public_host_without_token_and_bad_options(monkeypatch, capsys):
    monkeypatch.delenv("FLOWCREDIT_REWARD_TOKEN", raising=False)
    assert main(["--reward", "jpeg_compressibility", "--host", "0.0.0.0"]) == 2
    assert "without a token" in capsys.readouterr().err
    assert main(["--reward", "shapes", "--reward-options", "{bad"]) == 2
    with pytest.raises(ValueError, match="no --reward uses"):
        main(["--reward", "shapes", "--reward-options", '{"ocr": {}}'])


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak memory from /proc")
def test_cli_serves_two_rewards_and_bounds_memory_by_the_batch(monkeypatch):
    """128 images of 512² in one request to ``--max-batch 4``: peak memory stays that of one batch,
    not of the request (the old server kept every decoded image, ~1 MiB each: +120 MiB here)."""
    monkeypatch.setenv("FLOWCREDIT_REWARD_TOKEN", TOKEN)  # read by the server and by the client
    cmd = [sys.executable, "-m", "flowcredit", "serve-reward", "--reward", "jpeg_compressibility"]
    cmd += ["--reward", "jpeg_incompressibility", "--port", "0", "--max-batch", "4", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = []
    try:
        line = proc.stdout.readline()
        assert "on http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split(" on ")[1].split()[0]
        options = {"url": url, "reward": "jpeg_incompressibility"}
        assert get_reward("remote", {"remote": options})(torch.zeros(1, 3, 8, 8), ["a"], [{}]).item() > 0
        flat = encode_png(torch.full((3, 512, 512), 0.5))  # tiny PNG, 1 MiB of pixels once decoded
        port = int(url.rsplit(":", 1)[1])
        for n in (4, 128):  # one full batch, then 32 of them in one request
            status, data = request(port, body={"images": [flat] * n, "prompts": ["a"] * n})
            assert status == 200 and len(data["rewards"]) == n
            peaks.append(_peak_rss_mib(proc.pid))
        assert peaks[1] - peaks[0] < 16, peaks
        monkeypatch.delenv("FLOWCREDIT_REWARD_TOKEN")
        with pytest.raises(RemoteRewardError, match="401"):
            get_reward("remote", {"remote": {"url": url}})(torch.zeros(1, 3, 8, 8), ["a"], [{}])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_missing_serving_stack_names_the_extra(monkeypatch):
    from flowcredit.errors import UserError
    from flowcredit.rewards.server import create_app

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(UserError, match=r"'uvicorn'.*pip install 'flowcredit\[serve\]'"):
        create_app({"probe": Probe()})
    monkeypatch.setitem(sys.modules, "httpx2", None)
    remote = get_reward("remote", {"remote": {"url": "http://127.0.0.1:9"}})  # builds without it
    with pytest.raises(UserError, match=r"httpx2.*pip install 'flowcredit\[serve\]'"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])
