"""The reward server's wire format, shared by the server (server.py) and the ``remote`` client.

A score request is JSON ``{"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [{...}, ...]}``.
Images travel as 8-bit RGB PNG, so a remote reward sees ``round(255·x)/255``, exactly what the server
decodes. Nothing is ever pickled. Parsing checks everything that can be checked without decompressing
pixels (JSON shape, base64, the PNG signature, structure and checksums, each image's size against
``max_pixels``, one size per request), so a request that cannot fit is refused before any decoding;
pixels are decoded later, one reward batch at a time (:func:`decode_pngs`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from dataclasses import dataclass

import numpy as np
import torch

TOKEN_ENV = "FLOWCREDIT_REWARD_TOKEN"
_REPR_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # "<_io.BytesIO object at 0x7f…>"
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{8,}\b")


class ServeError(Exception):
    """A request the server answers with ``status`` (not 200) and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_PATH = re.compile(r"(?:[A-Za-z]:\\|~?/)(?:[\w.@+-]+[/\\])+[\w.@+-]*")  # /a/b/c, ~/x/y, C:\x\y


def without_paths(text: str) -> str:
    """``text`` with file paths of two or more parts replaced by ``(path)`` (a reward's exception
    may name its weights' location; the server's own log keeps the full text)."""
    return _PATH.sub("(path)", text)


def public_message(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` fit for an error body: memory addresses and secrets (of 8+ characters: a shorter one
    would garble common words) removed, at most 500 characters."""
    for secret in secrets:
        if len(secret) >= 8:
            text = text.replace(secret, "***")
    text = _ADDRESS.sub("(address)", _REPR_ADDRESS.sub("", text))
    return text if len(text) <= 500 else text[:497] + "..."


def encode_png(image: torch.Tensor) -> str:
    """``(3, H, W)`` in [0, 1] → base64 PNG (RGB, 8 bit)."""
    from PIL import Image

    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class ScoreRequest:
    """A parsed request: ``pngs`` (B PNG files, not decoded), their one ``size`` (W, H), ``prompts``,
    ``metadata``."""

    pngs: list[bytes]
    size: tuple[int, int] | None
    prompts: list[str]
    metadata: list[dict]


def _png_size(data, max_pixels: int) -> tuple[bytes, tuple[int, int]]:
    """Base64 PNG → its bytes and ``(W, H)``, read from the header; ``ServeError`` 400 or 413."""
    from PIL import Image

    if not isinstance(data, str):
        raise ServeError(400, "images must be base64 PNG strings")
    try:
        png = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(png)) as img:
            fmt, size = img.format, img.size
            if fmt == "PNG" and size[0] * size[1] <= max_pixels:
                img.verify()  # chunk structure and CRCs, without decompressing the pixels
    except Image.DecompressionBombError:
        raise ServeError(413, f"image refused: more than {Image.MAX_IMAGE_PIXELS} pixels") from None
    except (binascii.Error, ValueError, OSError, SyntaxError) as exc:  # PIL raises all of these
        raise ServeError(400, f"undecodable image: {type(exc).__name__}: {exc}") from None
    if fmt != "PNG":
        raise ServeError(400, f"images must be PNG, got {fmt}")
    if len(png) > 24 and png[24] > 8:  # IHDR's bit depth: 8-bit channels only (16-bit grey clipped at 255)
        raise ServeError(400, f"images must be 8-bit PNGs, got {png[24]} bits per channel")
    if size[0] * size[1] > max_pixels:
        raise ServeError(413, f"image of {size[0]}x{size[1]} exceeds {max_pixels} pixels")
    return png, size


def json_values_bound(body: bytes) -> int:
    """An upper bound on the JSON values in ``body``: its ``,`` ``:`` ``[`` ``{`` bytes, strings
    included (base64 has none, so a PNG costs nothing here). Counted at C speed, before parsing."""
    return sum(body.count(c) for c in (b",", b":", b"[", b"{")) + 1


def parse_score_request(body: bytes, max_pixels: int, max_values: int = 100_000) -> ScoreRequest:
    """JSON body → :class:`ScoreRequest`; ``ServeError`` 400 (malformed, nested too deep) or 413 (an
    image too large, or more than ``max_values`` JSON values: parsed, each costs 30–100 bytes however
    short it is in the body, so a body of tiny values would cost 20× its size; it is refused first)."""
    values = json_values_bound(body)
    if values > max_values:
        raise ServeError(
            413,
            f"body holds up to {values} JSON values, over max_json_values {max_values} (images, prompts "
            "and small metadata need far fewer)",
        )
    try:
        req = json.loads(body)
    except RecursionError:
        raise ServeError(400, "body is not JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServeError(400, f"body is not JSON: {exc}") from None
    if not isinstance(req, dict) or not {"images", "prompts"} <= set(req) <= {
        "images",
        "prompts",
        "metadata",
    }:
        raise ServeError(
            400, 'body must be {"images": [...], "prompts": [...], "metadata": [...] (optional)}'
        )
    images, prompts = req["images"], req["prompts"]
    metadata = req.get("metadata", [{} for _ in prompts] if isinstance(prompts, list) else None)
    if not (isinstance(images, list) and isinstance(prompts, list) and isinstance(metadata, list)):
        raise ServeError(400, "images, prompts and metadata must be lists")
    if not len(images) == len(prompts) == len(metadata):
        counts = f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata"
        raise ServeError(400, f"{counts}: must match")
    if not all(isinstance(p, str) for p in prompts) or not all(isinstance(m, dict) for m in metadata):
        raise ServeError(400, "prompts must be strings and metadata objects")
    pngs, sizes = [], set()
    for i in range(len(images)):
        png, size = _png_size(images[i], max_pixels)
        images[i] = None  # drop the base64 text as we go: the request holds each image once
        pngs.append(png)
        sizes.add(size)
    if len(sizes) > 1:
        raise ServeError(400, f"all images must have one size, got {sorted(sizes)}")
    return ScoreRequest(pngs, sizes.pop() if sizes else None, prompts, metadata)


def decode_pngs(pngs: list[bytes]) -> np.ndarray:
    """PNG files of one size → ``(B, H, W, 3)`` uint8 pixels; ``ServeError`` 400 if corrupt."""
    from PIL import Image

    try:
        arrays = []
        for png in pngs:
            with Image.open(io.BytesIO(png)) as img:
                arrays.append(np.asarray(img.convert("RGB")))
    except Exception as exc:  # corrupt pixel data that passed the checksums
        raise ServeError(400, f"undecodable image: {type(exc).__name__}: {exc}") from None
    return np.stack(arrays)
