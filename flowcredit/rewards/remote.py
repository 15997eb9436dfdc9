"""``remote`` reward: the client of ``flowcredit serve-reward`` (flowcredit/rewards/server.py).

On its first call the client reads the server's limits (``GET /health``). From then on it splits any
batch into requests that fit them (at most ``max_batch`` images, ``max_body_bytes`` and, besides the
images, ``max_text_bytes`` each) and keeps
up to ``in_flight`` of them open at once on one httpx2 connection pool. Connection errors, timeouts
and the answers 408, 429, 500, 502, 503 and 504 are retried, at most ``retries`` times per request,
after ``backoff · 2^k`` seconds. Every request of a call shares one deadline, ``timeout`` seconds after
the call starts, so a call never takes longer. Other answers (400, 401, 404, 413, 422) fail at once.
Every failure is a :class:`RemoteRewardError` naming the server's URL and the reason. Images travel
as 8-bit PNG (wire.py); nothing is ever pickled.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import torch

from flowcredit.errors import UserError
from flowcredit.rewards.wire import MARK_BYTES, TOKEN_ENV, encode_png

__all__ = ["TOKEN_ENV", "RemoteReward", "RemoteRewardError", "encode_png", "remote"]

RETRIED = {408, 429, 500, 502, 503, 504}
_BODY_FRAME = len('{"images":[],"prompts":[],"metadata":[]}')
_ITEM_FRAME = 5  # two quotes around the image and three commas at most, per image
_MARK = MARK_BYTES  # text the server counts for each image (the placeholder it parses in its stead)


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, refused the request or answered nonsense."""


def _httpx():
    try:
        import httpx2
    except ImportError:
        raise UserError(
            "the 'remote' reward needs httpx2, which is not installed: pip install 'flowcredit[serve]'"
        ) from None
    return httpx2


def _error_text(response) -> str:
    try:
        return str(response.json().get("error", ""))[:500]
    except (ValueError, AttributeError):
        return response.text[:200]


class RemoteReward:
    """``reward(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)``, computed by a server.

    Args: as :func:`remote`.
    """

    def __init__(self, url, token, reward, timeout, retries, backoff, in_flight):
        self.base = url.rstrip("/").removesuffix("/score")
        self.endpoint = f"{self.base}/score" + (f"/{quote(reward, safe='')}" if reward else "")
        self.token, self.reward_name = token, reward
        self.timeout, self.retries, self.backoff, self.in_flight = timeout, retries, backoff, in_flight
        self._limits: dict | None = None
        self._client = None
        self._lock = threading.Lock()

    def _http(self):
        with self._lock:
            if self._client is None:
                httpx2 = _httpx()
                limits = httpx2.Limits(
                    max_connections=self.in_flight, max_keepalive_connections=self.in_flight
                )
                headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
                self._client = httpx2.Client(limits=limits, headers=headers)
            return self._client

    def _request(self, url: str, deadline: float, body: bytes | None = None):
        """GET (or POST ``body``) with bounded retries; the decoded JSON answer."""
        httpx2, client = _httpx(), self._http()
        last, tries = "no try made", 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteRewardError(
                    f"reward server {url}: no answer within timeout={self.timeout}s "
                    f"({tries} tries); last error: {last}"
                )
            tries += 1
            try:
                if body is None:
                    response = client.get(url, timeout=left)
                else:
                    headers = {"Content-Type": "application/json"}
                    response = client.post(url, content=body, headers=headers, timeout=left)
            except httpx2.TransportError as exc:  # refused, reset, timed out
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    try:
                        return response.json()
                    except ValueError as exc:
                        raise RemoteRewardError(f"reward server {url} answered invalid JSON: {exc}") from None
                last = f"HTTP {response.status_code}: {_error_text(response)}"
                if response.status_code not in RETRIED:
                    raise RemoteRewardError(f"reward server {url} refused the request: {last}")
            if tries > self.retries:
                raise RemoteRewardError(f"reward server {url} failed after {tries} tries; last error: {last}")
            time.sleep(max(0.0, min(self.backoff * 2 ** (tries - 1), deadline - time.monotonic())))

    def limits(self, deadline: float) -> dict:
        """The server's advertised limits (read once)."""
        if self._limits is None:
            info = self._request(f"{self.base}/health", deadline)
            served = info.get("rewards") if isinstance(info, dict) else None
            if self.reward_name and isinstance(served, list) and self.reward_name not in served:
                raise RemoteRewardError(
                    f"reward server {self.base} serves {served}, not reward {self.reward_name!r}"
                )
            self._limits = {
                "max_body_bytes": int(info.get("max_body_bytes", 64 << 20)),
                "max_batch": int(info.get("max_batch", 16)),
                "max_pixels": info.get("max_pixels"),
                "max_text_bytes": float(info.get("max_text_bytes", math.inf)),  # older servers: none
            }
        return self._limits

    def _chunks(self, encoded: list[tuple[str, str, str]], limits: dict) -> list[list[int]]:
        """Indices of the images of each request: at most ``max_batch``, ``max_body_bytes`` and
        ``max_text_bytes`` besides the images."""
        chunks, size, text = [[]], _BODY_FRAME, _BODY_FRAME
        for i, (image, prompt, meta) in enumerate(encoded):
            item, words = self._fitting(i, image, prompt, meta, limits)
            full = len(chunks[-1]) == limits["max_batch"] or size + item > limits["max_body_bytes"]
            if full or text + words > limits["max_text_bytes"]:
                chunks.append([])
                size, text = _BODY_FRAME, _BODY_FRAME
            chunks[-1].append(i)
            size, text = size + item, text + words
        return chunks

    def _fitting(self, i: int, image: str, prompt: str, meta: str, limits: dict) -> tuple[int, int]:
        """Bytes of item ``i`` in a request body, and of them those besides its image;
        :class:`RemoteRewardError` if it alone is too large for a request."""
        words = len(prompt.encode()) + len(meta.encode()) + _ITEM_FRAME + _MARK
        item = len(image) + words - _MARK
        if _BODY_FRAME + item > limits["max_body_bytes"]:
            raise RemoteRewardError(
                f"reward server {self.base}: image {i} alone needs a {_BODY_FRAME + item}-byte request, "
                f"over the server's max_body_bytes {limits['max_body_bytes']}"
            )
        if _BODY_FRAME + words > limits["max_text_bytes"]:
            raise RemoteRewardError(
                f"reward server {self.base}: the prompt and metadata of image {i} need {words} bytes, "
                f"over the server's max_text_bytes {limits['max_text_bytes']:.0f}"
            )
        return item, words

    def _post_chunk(self, encoded, chunk: list[int], deadline: float) -> list:
        images, prompts, metas = zip(*(encoded[i] for i in chunk))
        body = '{"images":[' + ",".join(f'"{s}"' for s in images) + '],"prompts":[' + ",".join(prompts)
        body += '],"metadata":[' + ",".join(metas) + "]}"
        try:
            answer = self._request(self.endpoint, deadline, body.encode())
        except RemoteRewardError as exc:
            if len(chunk) == len(encoded):
                raise
            raise RemoteRewardError(  # a 422 names e.g. metadata[2]: counted from the request's first
                f"{exc} (in the request of images {chunk[0]}–{chunk[-1]} of this call, numbered from 0 there)"
            ) from None
        values = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(values, list) or len(values) != len(chunk):
            raise RemoteRewardError(
                f"reward server {self.endpoint} answered {answer!r:.200} for {len(chunk)} images"
            )
        return [math.nan if v is None else float(v) for v in values]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout
        metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
        try:
            metas = [json.dumps(m, allow_nan=False) for m in metadata]
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"reward 'remote': metadata must be plain JSON (no NaN, no objects): {exc}"
            ) from exc
        limits = self.limits(deadline)
        height, width = images.shape[-2:]
        if limits["max_pixels"] and height * width > limits["max_pixels"]:
            raise RemoteRewardError(
                f"reward server {self.base} takes images of at most {limits['max_pixels']} pixels, "
                f"these are {width}x{height}"
            )
        encoded = []
        for i, (img, p, m) in enumerate(zip(images, prompts, metas)):  # refuse at the first too-large image
            encoded.append((encode_png(img), json.dumps(p), m))
            self._fitting(i, *encoded[-1], limits)
        chunks = self._chunks(encoded, limits)
        if len(chunks) == 1:
            return torch.tensor(self._post_chunk(encoded, chunks[0], deadline), dtype=torch.float32)
        with ThreadPoolExecutor(min(self.in_flight, len(chunks))) as pool:
            futures = [pool.submit(self._post_chunk, encoded, chunk, deadline) for chunk in chunks]
            try:
                values = [v for future in futures for v in future.result()]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return torch.tensor(values, dtype=torch.float32)


def remote(
    *,
    url: str,
    token: str | None = None,
    reward: str | None = None,
    timeout: float = 300.0,
    retries: int = 3,
    backoff: float = 1.0,
    in_flight: int = 4,
) -> RemoteReward:
    """Factory of the ``remote`` reward.

    Args:
        url: the server, e.g. ``http://10.0.0.5:8000``.
        token: bearer token; default: the environment variable ``FLOWCREDIT_REWARD_TOKEN`` (if set).
        reward: which of the server's rewards (its ``--reward`` spec); default: the first it serves.
        timeout: seconds for a whole call, retries included. retries: tries after the first, per
            request. backoff: first wait before a retry, doubling. in_flight: requests open at once.

    Returns:
        ``reward(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)`` float32; a non-finite
        reward comes back as NaN (JSON ``null``).
    """
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"reward 'remote': option 'url' must start with http:// or https://, got {url!r}")
    if retries < 0 or backoff < 0 or timeout <= 0 or in_flight < 1:
        raise ValueError("reward 'remote': options retries, backoff must be ≥ 0, timeout > 0, in_flight ≥ 1")
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return RemoteReward(url, token, reward, timeout, retries, backoff, in_flight)
