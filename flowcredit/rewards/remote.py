"""``remote`` reward: a client of ``flowcredit serve-reward`` (flowcredit/rewards/server.py).

Images travel as base64 PNG (8-bit, so a remote reward sees ``round(255·x)/255``, exactly what the
server decodes), prompts and metadata as JSON; nothing is ever pickled. Connection errors, timeouts
and 5xx answers are retried with exponential backoff (``backoff · 2^k`` seconds); a 4xx answer
(bad token, malformed request, a prompt the reward rejects) is raised at once.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import os
import time
import urllib.error
import urllib.request

import numpy as np
import torch

TOKEN_ENV = "FLOWCREDIT_REWARD_TOKEN"


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or refused the request."""


def encode_png(image: torch.Tensor) -> str:
    """``(3, H, W)`` in [0, 1] → base64 PNG (RGB, 8 bit)."""
    from PIL import Image

    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _endpoint(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"reward 'remote': option 'url' must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url if url.endswith("/score") else url + "/score"


def _post(endpoint: str, body: bytes, token: str | None, timeout: float) -> dict:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read()).get("error", "")
    except (ValueError, AttributeError, OSError):
        return ""


def post_with_retries(
    endpoint: str, body: bytes, token, timeout: float, retries: int, backoff: float
) -> dict:
    """POST ``body``; retry connection errors, timeouts and 5xx; raise :class:`RemoteRewardError`."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            return _post(endpoint, body, token, timeout)
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code} {exc.reason}: {_error_text(exc)}"
            if exc.code < 500:
                raise RemoteRewardError(f"reward server {endpoint} refused the request: {last}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, reset, timeout
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        except ValueError as exc:  # 200 with a body that is not JSON
            last = f"invalid JSON answer: {exc}"
    raise RemoteRewardError(f"reward server {endpoint} failed after {retries + 1} tries; last error: {last}")


def remote(
    *, url: str, token: str | None = None, timeout: float = 300.0, retries: int = 3, backoff: float = 1.0
):
    """Factory of the ``remote`` reward.

    Args:
        url: the server, e.g. ``http://10.0.0.5:8000`` (``/score`` is appended unless present).
        token: bearer token; default: the environment variable ``FLOWCREDIT_REWARD_TOKEN`` (if set).
        timeout: seconds per request. retries: tries after the first. backoff: first wait, doubling.

    Returns:
        ``reward(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)`` float32; a non-finite
        reward comes back as NaN (JSON ``null``).
    """
    endpoint = _endpoint(url)
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    if retries < 0 or backoff < 0 or timeout <= 0:
        raise ValueError("reward 'remote': options retries, backoff must be ≥ 0 and timeout > 0")

    def reward(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        payload = {"images": [encode_png(img) for img in images], "prompts": list(prompts)}
        payload["metadata"] = list(metadata) if metadata is not None else [{} for _ in prompts]
        try:
            body = json.dumps(payload, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"reward 'remote': metadata must be plain JSON (no NaN, no objects): {exc}"
            ) from exc
        answer = post_with_retries(endpoint, body, token, timeout, retries, backoff)
        values = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(values, list) or len(values) != images.shape[0]:
            raise RemoteRewardError(
                f"reward server {endpoint} answered {answer!r:.200} for {images.shape[0]} images"
            )
        return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)

    return reward
