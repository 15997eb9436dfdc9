"""``flowcredit serve-reward``: serve any registered reward (or ``pkg.mod:fn``, or a mix) over HTTP.

    POST /score   {"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [{...}, ...]}
                  -> 200 {"rewards": [float | null, ...]}      (null: a non-finite reward)
    GET  /health  -> 200 {"status": "ok", "reward": NAME}      (no token needed)

JSON only, never pickle. Errors answer ``{"error": "..."}``: 401 without the bearer token (compared in
constant time), 411 without a Content-Length (chunked bodies are refused), 413 when Content-Length
exceeds ``--max-body-mb`` (answered before reading the body) or an image exceeds ``--max-pixels``, 400
for a malformed request (bad JSON, wrong types, undecodable PNG, mixed image sizes, length mismatch),
422 when the reward rejects its input (``ValueError``, e.g. an OCR prompt without quotes), 500 when
it fails otherwise. The server keeps serving after any of them. Requests run in threads; reward calls
are serialised by a lock and split into chunks of ``--max-batch`` images. The client is the
``remote`` reward (flowcredit/rewards/remote.py).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import io
import ipaddress
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from flowcredit.rewards import get_reward
from flowcredit.rewards.remote import TOKEN_ENV


class HTTPError(Exception):
    """An answer other than 200: ``status`` and a message for ``{"error": ...}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def open_png(data, max_pixels: int):
    """Base64 PNG → a lazily decoded PIL image (header checked only); ``HTTPError`` 400 / 413."""
    from PIL import Image

    if not isinstance(data, str):
        raise HTTPError(400, "images must be base64 PNG strings")
    try:
        img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
    except (binascii.Error, ValueError, OSError) as exc:
        raise HTTPError(400, f"undecodable image: {exc}") from None
    except Exception as exc:  # PIL's DecompressionBombError
        raise HTTPError(413, f"image refused: {exc}") from None
    if img.format != "PNG":
        raise HTTPError(400, f"images must be PNG, got {img.format}")
    if img.width * img.height > max_pixels:  # checked before decompressing the pixels
        raise HTTPError(413, f"image of {img.width}x{img.height} exceeds {max_pixels} pixels")
    return img


def to_tensor(images: list) -> torch.Tensor:
    """PIL images of one size → ``(B, 3, H, W)`` float32 in [0, 1]; ``HTTPError`` 400 if corrupt."""
    try:
        arrays = [np.array(img.convert("RGB")) for img in images]
    except Exception as exc:  # truncated or corrupt pixel data
        raise HTTPError(400, f"undecodable image: {exc}") from None
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0


def decode_request(body: bytes, max_pixels: int) -> tuple[list, list[str], list[dict]]:
    """JSON body → ``images`` (B lazily decoded PIL images of one size), ``prompts`` (B), ``metadata`` (B)."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"body is not JSON: {exc}") from None
    if not isinstance(req, dict) or not {"images", "prompts"} <= set(req) <= {
        "images",
        "prompts",
        "metadata",
    }:
        raise HTTPError(400, 'body must be {"images": [...], "prompts": [...], "metadata": [...] (optional)}')
    images, prompts = req["images"], req["prompts"]
    metadata = req.get("metadata", [{} for _ in prompts] if isinstance(prompts, list) else None)
    if not (isinstance(images, list) and isinstance(prompts, list) and isinstance(metadata, list)):
        raise HTTPError(400, "images, prompts and metadata must be lists")
    if not (len(images) == len(prompts) == len(metadata)):
        counts = f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata"
        raise HTTPError(400, f"{counts}: must match")
    if not all(isinstance(p, str) for p in prompts) or not all(isinstance(m, dict) for m in metadata):
        raise HTTPError(400, "prompts must be strings and metadata objects")
    pils = [open_png(s, max_pixels) for s in images]
    if len({img.size for img in pils}) > 1:
        raise HTTPError(400, f"all images must have one size, got {sorted({img.size for img in pils})}")
    return pils, prompts, metadata


class RewardServer(ThreadingHTTPServer):
    """A threaded HTTP server around ``reward_fn(images, prompts, metadata) -> (B,)``."""

    daemon_threads = True

    def __init__(
        self,
        address,
        reward_fn,
        *,
        name="reward",
        token=None,
        max_body_bytes=64 << 20,
        max_batch=16,
        max_pixels=2048 * 2048,
        request_timeout=60.0,
        quiet=False,
    ):
        if max_batch < 1 or max_body_bytes < 1 or max_pixels < 1:
            raise ValueError("max_batch, max_body_bytes and max_pixels must be positive")
        self.reward_fn, self.name, self.quiet = reward_fn, name, quiet
        self.expected_auth = f"Bearer {token}".encode() if token else None
        self.max_body_bytes, self.max_batch, self.max_pixels = max_body_bytes, max_batch, max_pixels
        self.request_timeout = request_timeout
        self.reward_lock = threading.Lock()
        super().__init__(address, RewardHandler)

    def score(self, images: list, prompts: list[str], metadata: list[dict]) -> list[float | None]:
        """Rewards of B PIL images, decoded and scored in chunks of ``max_batch`` (bounding memory);
        non-finite values become None."""
        out = []
        for i in range(0, len(prompts), self.max_batch):
            j = i + self.max_batch
            chunk = to_tensor(images[i:j])
            with self.reward_lock:
                value = self.reward_fn(chunk, prompts[i:j], metadata[i:j])
            value = torch.as_tensor(value, dtype=torch.float32).reshape(-1).cpu()
            if value.shape[0] != len(prompts[i:j]):
                raise RuntimeError(f"reward returned {value.shape[0]} values for {len(prompts[i:j])} images")
            out += [v if math.isfinite(v) else None for v in value.tolist()]
        return out


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "flowcredit-reward/1"

    @property
    def timeout(self) -> float:  # socket timeout, so a stalled client cannot hold a thread forever
        return self.server.request_timeout

    def log_message(self, format, *args):
        if not self.server.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, obj: dict, close: bool = False) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if close:  # the request body was not read: the connection cannot be reused
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)
        if close:
            self._linger()

    def _linger(self, seconds: float = 1.0) -> None:
        """Half-close, then discard what the client still sends for a moment (bounded by
        ``max_body_bytes``): closing with unread input sends a TCP reset, which can destroy the error
        answer before the client reads it."""
        budget, deadline = self.server.max_body_bytes, time.monotonic() + seconds
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.1)
            while budget > 0 and time.monotonic() < deadline:
                chunk = self.connection.recv(min(budget, 1 << 16))
                if not chunk:
                    break
                budget -= len(chunk)
        except OSError:
            pass

    def do_GET(self):
        if self.path == "/health":
            self._send(
                200,
                {"status": "ok", "reward": self.server.name, "max_body_bytes": self.server.max_body_bytes},
            )
        else:
            self._send(404, {"error": f"no such path {self.path!r}; GET /health, POST /score"})

    def _body_length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "chunked bodies are not accepted; send a Content-Length")
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise HTTPError(411, "Content-Length required")
        if not raw.strip().isdigit():
            raise HTTPError(400, f"bad Content-Length {raw!r}")
        n = int(raw)
        if n > self.server.max_body_bytes:
            raise HTTPError(413, f"body of {n} bytes exceeds {self.server.max_body_bytes}")
        return n

    def _check(self) -> int:
        """Path, token and body length, before reading the body."""
        if self.path != "/score":
            raise HTTPError(404, f"no such path {self.path!r}; POST /score")
        expected = self.server.expected_auth
        given = self.headers.get("Authorization", "").encode("latin-1", "replace")
        if expected is not None and not hmac.compare_digest(given, expected):
            raise HTTPError(401, "missing or wrong bearer token")
        return self._body_length()

    def do_POST(self):
        try:
            n = self._check()
        except HTTPError as exc:
            return self._send(exc.status, {"error": str(exc)}, close=True)
        body = self.rfile.read(n)
        try:
            if len(body) != n:
                raise HTTPError(400, f"body ended after {len(body)} of {n} bytes")
            images, prompts, metadata = decode_request(body, self.server.max_pixels)
            try:
                rewards = self.server.score(images, prompts, metadata)
            except HTTPError:
                raise
            except ValueError as exc:
                raise HTTPError(422, f"reward rejected the input: {exc}") from None
            except Exception as exc:
                if not self.server.quiet:
                    traceback.print_exc()
                raise HTTPError(500, f"reward failed: {type(exc).__name__}: {exc}") from None
        except HTTPError as exc:
            return self._send(exc.status, {"error": str(exc)})
        self._send(200, {"rewards": rewards})


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowcredit serve-reward", description=__doc__.split("\n\n")[0])
    p.add_argument("--reward", required=True, help="registry name, 'pkg.mod:fn' or a mix 'a=1,b=0.5'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--token", default=None, help=f"bearer token (prefer the env variable {TOKEN_ENV})")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body, MiB")
    p.add_argument("--max-batch", type=int, default=16, help="images per reward call")
    p.add_argument("--max-pixels", type=int, default=2048 * 2048, help="largest image, in pixels")
    p.add_argument("--reward-options", default="", help='JSON {"name": {"option": value}}, as reward_options')
    p.add_argument("--quiet", action="store_true", help="do not log each request")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flowcredit serve-reward``; blocks until interrupted."""
    args = _parser().parse_args(argv)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if token is None and not _is_loopback(args.host):
        print(
            f"serve-reward: refusing to serve on {args.host} without a token (--token or {TOKEN_ENV})",
            file=sys.stderr,
        )
        return 2
    try:
        options = json.loads(args.reward_options) if args.reward_options else None
    except ValueError as exc:
        print(f"serve-reward: --reward-options is not JSON: {exc}", file=sys.stderr)
        return 2
    reward = get_reward(args.reward, options)
    server = RewardServer(
        (args.host, args.port),
        reward,
        name=args.reward,
        token=token,
        quiet=args.quiet,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_batch=args.max_batch,
        max_pixels=args.max_pixels,
    )
    host, port = server.server_address[:2]
    print(f"serving reward {args.reward!r} on http://{host}:{port} (POST /score, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
