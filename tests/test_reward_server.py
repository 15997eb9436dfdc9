"""Reward server and ``remote`` client on loopback: rewards/server.py, rewards/remote.py."""

import base64
import http.client
import io
import json
import threading
import time

import pytest
import torch

from flowcredit.rewards import get_reward
from flowcredit.rewards.remote import RemoteRewardError, encode_png
from flowcredit.rewards.server import RewardServer, main

TOKEN = "s3cret-token"


class Probe:
    """brightness + len(prompt) + metadata["bonus"]; records batch sizes; can fail on demand."""

    def __init__(self):
        self.batches, self.fail_next = [], []

    def __call__(self, images, prompts, metadata):
        self.batches.append(len(prompts))
        if self.fail_next:
            raise self.fail_next.pop(0)
        bonus = torch.tensor([float(m.get("bonus", 0)) for m in metadata])
        return images.mean(dim=(1, 2, 3)) + torch.tensor([float(len(p)) for p in prompts]) + bonus


@pytest.fixture
def served():
    """``(probe, port)``: a RewardServer in a thread on a free loopback port."""
    probe = Probe()
    server = RewardServer(
        ("127.0.0.1", 0),
        probe,
        name="probe",
        token=TOKEN,
        max_body_bytes=200_000,
        max_batch=2,
        max_pixels=64 * 64,
        quiet=True,
    )
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield probe, server.server_address[1]
    server.shutdown()
    server.server_close()


def request(port, method="POST", path="/score", body=None, headers=None, token=TOKEN):
    """One raw request → ``(status, decoded JSON)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    hdrs = {"Authorization": f"Bearer {token}"} if token else {}
    hdrs.update(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    status, data = resp.status, json.loads(resp.read() or b"null")
    conn.close()
    return status, data


def payload(n=3, size=16):
    images = torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(n))
    return images, {"images": [encode_png(x) for x in images], "prompts": ["ab"] * n, "metadata": [{}] * n}


def test_health_and_ok_with_batching(served):
    probe, port = served
    assert request(port, "GET", "/health", token=None) == (
        200,
        {"status": "ok", "reward": "probe", "max_body_bytes": 200_000},
    )
    images, body = payload(5)
    status, data = request(port, body=body)
    assert status == 200 and len(data["rewards"]) == 5
    assert probe.batches == [2, 2, 1]
    assert data["rewards"] == pytest.approx((images.mul(255).round().div(255).mean((1, 2, 3)) + 2).tolist())


def _raw(port, lines: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(lines)
        return s.recv(4096)


@pytest.mark.parametrize(
    ("body", "headers", "token", "code"),
    [
        (b"{}", {}, None, 401),
        (b"{}", {}, "wrong", 401),
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
    status, data = request(port, body=body, headers=headers, token=token)
    assert status == code and "error" in data
    assert request(port, body=payload(1)[1])[0] == 200


def test_length_mismatch_and_bad_metadata(served):
    _, port = served
    _, body = payload(2)
    assert request(port, body={**body, "prompts": ["a"]})[0] == 400
    assert request(port, body={**body, "metadata": [{}, 3]})[0] == 400


def test_oversize_image_and_mixed_sizes(served):
    _, port = served
    _, big = payload(1, size=80)  # 6400 > max_pixels 4096
    assert request(port, body=big)[0] == 413
    _, small = payload(1, size=16)
    _, other = payload(1, size=24)
    mixed = {
        **small,
        "images": small["images"] + other["images"],
        "prompts": ["a", "b"],
        "metadata": [{}, {}],
    }
    assert request(port, body=mixed)[0] == 400


def test_missing_content_length_and_chunked_are_refused(served):
    _, port = served
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    answer = _raw(port, b"POST /score HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
    assert answer.startswith(b"HTTP/1.0 411")
    chunked = b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n" + auth + b"\r\n0\r\n\r\n"
    assert _raw(port, chunked).startswith(b"HTTP/1.0 411")
    assert request(port, body=payload(1)[1])[0] == 200


def test_reward_errors_422_and_500_then_recovers(served):
    probe, port = served
    probe.fail_next = [ValueError("prompt has no quotes"), RuntimeError("boom")]
    _, body = payload(1)
    assert request(port, body=body) == (422, {"error": "reward rejected the input: prompt has no quotes"})
    status, data = request(port, body=body)
    assert status == 500 and "boom" in data["error"]
    assert request(port, body=body)[0] == 200
    assert request(port, "GET", "/nope")[0] == 404


def test_round_trip_matches_local_reward():
    local = get_reward("jpeg_compressibility")
    server = RewardServer(("127.0.0.1", 0), local, token=TOKEN, max_batch=2, quiet=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = get_reward("remote", {"remote": {"url": url, "token": TOKEN}})
        images = torch.rand(3, 3, 24, 24, generator=torch.Generator().manual_seed(2))
        quantised = images.mul(255).round().div(255)  # what the PNG carries
        got = remote(images, ["a", "b", "c"], [{"k": 1}, {}, {}])
        assert torch.equal(got, local(quantised, ["a", "b", "c"], [{}, {}, {}]))
    finally:
        server.shutdown()
        server.server_close()


def test_client_retries_5xx_then_succeeds_and_sends_metadata(served):
    probe, port = served
    probe.fail_next = [RuntimeError("transient"), RuntimeError("transient")]
    remote = get_reward(
        "remote", {"remote": {"url": f"http://127.0.0.1:{port}/", "token": TOKEN, "backoff": 0.01}}
    )
    got = remote(torch.zeros(1, 3, 8, 8), ["abc"], [{"bonus": 10}])
    assert got.tolist() == [13.0] and probe.batches == [1, 1, 1]


def test_client_does_not_retry_4xx(served):
    probe, port = served
    remote = get_reward(
        "remote", {"remote": {"url": f"http://127.0.0.1:{port}", "token": "bad", "backoff": 5}}
    )
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"127.0.0.1:{port}/score.*401"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])
    assert time.monotonic() - start < 2.0 and probe.batches == []


def test_client_names_url_after_last_try():
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = get_reward(
        "remote", {"remote": {"url": f"http://127.0.0.1:{port}", "retries": 2, "backoff": 0.01}}
    )
    with pytest.raises(RemoteRewardError, match=rf"127.0.0.1:{port}/score failed after 3 tries"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])


def test_client_rejects_non_json_metadata_and_bad_url():
    remote = get_reward("remote", {"remote": {"url": "http://127.0.0.1:9"}})
    with pytest.raises(ValueError, match="metadata must be plain JSON"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{"x": object()}])
    with pytest.raises(ValueError, match="'url'"):
        get_reward("remote", {"remote": {"url": "file:///etc/passwd"}})


def test_main_refuses_public_host_without_token(monkeypatch, capsys):
    monkeypatch.delenv("FLOWCREDIT_REWARD_TOKEN", raising=False)
    assert main(["--reward", "jpeg_compressibility", "--host", "0.0.0.0"]) == 2
    assert "without a token" in capsys.readouterr().err
    assert main(["--reward", "shapes", "--reward-options", "{bad"]) == 2


def test_png_encoding_is_exact_for_8bit_images():
    from PIL import Image

    x = torch.randint(0, 256, (3, 5, 7)).float() / 255
    arr = torch.from_numpy(__import__("numpy").array(Image.open(io.BytesIO(base64.b64decode(encode_png(x))))))
    assert torch.equal(arr.permute(2, 0, 1).float() / 255, x)


def test_truncated_png_is_400(served):
    _, port = served
    _, body = payload(1, size=32)
    raw = base64.b64decode(body["images"][0])
    body["images"] = [base64.b64encode(raw[: len(raw) // 2]).decode()]  # header intact, pixels cut
    status, data = request(port, body=body)
    assert status == 400 and "undecodable" in data["error"]
    assert request(port, body=payload(1)[1])[0] == 200


def test_cli_serves_until_terminated(monkeypatch):
    import subprocess
    import sys
    import urllib.request

    monkeypatch.setenv("FLOWCREDIT_REWARD_TOKEN", TOKEN)  # read by the server and by the client
    cmd = [
        sys.executable,
        "-m",
        "flowcredit",
        "serve-reward",
        "--reward",
        "jpeg_compressibility",
        "--port",
        "0",
    ]
    proc = subprocess.Popen(cmd + ["--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving reward 'jpeg_compressibility' on http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split(" on ")[1].split()[0]
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert json.loads(r.read())["reward"] == "jpeg_compressibility"
        remote = get_reward("remote", {"remote": {"url": url}})
        assert remote(torch.zeros(1, 3, 8, 8), ["a"], [{}]).shape == (1,)
        monkeypatch.delenv("FLOWCREDIT_REWARD_TOKEN")
        with pytest.raises(RemoteRewardError, match="401"):
            get_reward("remote", {"remote": {"url": url}})(torch.zeros(1, 3, 8, 8), ["a"], [{}])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
