"""The ``remote`` client (rewards/remote.py) and the ``flowcredit serve-reward`` command, on loopback."""

import base64
import io
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from reward_serving import TOKEN, Probe, expected, request

from flowcredit.rewards import get_reward
from flowcredit.rewards.remote import RemoteRewardError, encode_png
from flowcredit.rewards.server import Limits, main, start_server

# --- the client -----------------------------------------------------------------------------------


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


def test_client_splits_a_batch_by_the_servers_text_limit():
    """6 prompts of 600 bytes against max_text_bytes 2,000: the client sends requests of at most 3 of
    them (one request would be refused with 413); a prompt alone over the limit fails before sending."""
    probe = Probe()
    with start_server({"probe": probe}, limits=Limits(max_text_bytes=2000, max_batch=8)) as running:
        remote = get_reward("remote", {"remote": {"url": running.url}})
        images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        prompts = [f"{i}" + "p" * 599 for i in range(6)]
        assert remote(images, prompts, [{} for _ in prompts]).tolist() == pytest.approx(
            expected(images, prompts)
        )
        with pytest.raises(RemoteRewardError, match="max_text_bytes 2000"):
            remote(images[:1], ["p" * 2000], [{}])
    assert sum(probe.batches) == 6


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
    remote = get_reward("remote", {"remote": {"url": server.url, "token": "bad-token-0123", "backoff": 120}})
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"{server.url}/score refused the request: HTTP 401"):
        remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])
    assert time.monotonic() - start < 60 and probe.batches == []  # a retry would first wait 120 s
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
    (retries + 1) × timeout plus backoff as before (6 × 1 s + 1 + 2 + 4 + 8 + 16 s = 37 s here; the
    bound of 15 s separates the two on any machine)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        remote = get_reward("remote", {"remote": {"url": url, "timeout": 1.0, "retries": 5, "backoff": 1.0}})
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=rf"{url}/health.*within timeout=1.0s"):
            remote(torch.zeros(1, 3, 8, 8), ["a"], [{}])
        assert time.monotonic() - start < 15


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


def test_client_refuses_an_oversized_image_before_encoding_the_rest(monkeypatch):
    """An image too large for the server's body limit is refused as soon as it is encoded (the client
    used to encode the whole batch first: 23 s for 300 images)."""
    import flowcredit.rewards.remote as remote_module

    encoded = []
    real = remote_module.encode_png
    monkeypatch.setattr(remote_module, "encode_png", lambda img: encoded.append(1) or real(img))
    with start_server({"probe": Probe()}, limits=Limits(max_body_bytes=2_000, max_batch=4)) as running:
        remote = get_reward("remote", {"remote": {"url": running.url}})
        images = torch.rand(300, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # ~4 kB each
        with pytest.raises(RemoteRewardError, match="image 0 alone needs"):
            remote(images, ["a"] * 300, [{}] * 300)
    assert len(encoded) == 1


def test_serve_reward_warns_about_a_short_token(capsys):
    from flowcredit.errors import UserError

    with pytest.raises(UserError, match="unknown reward"):  # stops right after the warning, before serving
        main(["--reward", "nope_not_a_reward", "--token", "short", "--port", "0"])
    assert "a token of 5 characters is easy to guess" in capsys.readouterr().err
