"""The reward server's wire format, shared by the server (server.py) and the ``remote`` client.

A score request is JSON ``{"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [{...}, ...]}``.
Images travel as 8-bit RGB PNG, so a remote reward sees ``round(255·x)/255``, exactly what the server
decodes. Nothing is ever pickled. Parsing takes the images (long base64 strings) out of the body
before the rest is parsed as JSON (:func:`split_images`), so they never become Python strings and
that rest, the only part a character can widen (to 4 bytes), is bounded by ``max_text_bytes``. It
checks everything that can be checked without decompressing pixels (JSON shape, base64, the PNG
format, bit depth and colour type as PIL reads them, chunk structure and checksums, each image's size
against ``max_pixels``, one size per request), so a request that cannot fit is refused before any
decoding; pixels are decoded later, one reward batch at a time (:func:`decode_pngs`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import secrets
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


def public_message(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` fit for an error body: memory addresses and secrets (of 8+ characters: a shorter one
    would garble common words) removed, lone surrogates escaped (the body must encode as UTF-8), at
    most 500 characters."""
    for secret in secrets:
        if len(secret) >= 8:
            text = text.replace(secret, "***")
    text = _ADDRESS.sub("(address)", _REPR_ADDRESS.sub("", text))
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
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


EXACT_RAWMODES = frozenset({"1", "L;2", "L;4", "L", "LA", "P;1", "P;2", "P;4", "P", "RGB", "RGBA"})
"""PNG pixel layouts (PIL's raw modes) whose 8-bit RGB is exact: 8-bit grey, RGB, RGBA, palettes,
and 1/2/4-bit grey (scaled exactly). 16-bit ones (e.g. ``I;16B``, ``RGB;16B``) are refused: PIL
would clip or truncate them."""


def _check_layout(img) -> None:
    """``ServeError`` 400 unless PIL decodes ``img`` (as it parsed the header, wherever IHDR was and
    however many there were) from one of :data:`EXACT_RAWMODES`."""
    rawmode = img.tile[0][3] if img.tile else None
    if rawmode not in EXACT_RAWMODES:
        raise ServeError(400, f"not an 8-bit PNG (grey, RGB, RGBA or palette): PIL reads it as {rawmode}")


def _png(data, max_pixels: int) -> tuple[bytes, tuple[int, int]]:
    """An image of the body (its base64: bytes-like, or a short ``str``) → PNG bytes and ``(W, H)``,
    checked by PIL without decoding pixels: format, layout, size against ``max_pixels``, chunk structure
    and CRCs; ``ServeError`` 400 or 413."""
    from PIL import Image

    if not isinstance(data, (str, memoryview)):
        raise ServeError(400, f"must be a base64 PNG string, got {_json_type(data)}")
    try:
        png = base64.b64decode(data, validate=True) if isinstance(data, str) else binascii.a2b_base64(data)
        with Image.open(io.BytesIO(png)) as img:
            fmt, size = img.format, img.size
            if fmt != "PNG":
                raise ServeError(400, f"must be a PNG, got {fmt}")
            _check_layout(img)
            if size[0] * size[1] > max_pixels:
                raise ServeError(413, f"image of {size[0]}x{size[1]} exceeds {max_pixels} pixels")
            img.verify()  # chunk structure and CRCs, without decompressing the pixels
    except Image.DecompressionBombError:
        raise ServeError(413, f"image refused: more than {Image.MAX_IMAGE_PIXELS} pixels") from None
    except (binascii.Error, ValueError, OSError, SyntaxError) as exc:  # PIL raises all of these
        raise ServeError(400, f"undecodable image: {type(exc).__name__}: {exc}") from None
    return png, size


def json_values_bound(body: bytes) -> int:
    """An upper bound on the JSON values in ``body``: its ``,`` ``:`` ``[`` ``{`` bytes, strings
    included (base64 has none, so a PNG costs nothing here). Counted at C speed, before parsing."""
    return sum(body.count(c) for c in (b",", b":", b"[", b"{")) + 1


_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
_ESCAPED_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string's rest, to its closing quote
MARK_BYTES = 32  # text a placeholder takes (``"\u0000`` + 16 hex digits + ``:k"``), counted per image


def _over(text: int, max_text: int) -> ServeError:
    return ServeError(
        413,
        f"body holds over {max_text} bytes besides its images (max_text_bytes; prompts, metadata, JSON "
        f"syntax and {MARK_BYTES} bytes an image), {text} at least",
    )


def _all_base64(view: memoryview, a: int, b: int, step: int = 1 << 20) -> bool:
    """Whether ``view[a:b]`` holds base64 characters only; copied a MiB at a time (C speed)."""
    return not any(bytes(view[i : min(b, i + step)]).translate(None, _ALPHABET) for i in range(a, b, step))


def image_spans(body, max_text: int) -> list[tuple[int, int]]:
    """Where the images of ``body`` lie: its JSON strings of 64 characters or more, all base64 (quotes
    excluded). The rest, text, is counted as the scan goes, ``MARK_BYTES`` an image included, and
    413 is raised as soon as it exceeds ``max_text``: a body costs at most ``max_text`` bytes of
    scanning in Python's regex engine, its images a pass of ``find`` and one of ``translate`` (a MiB
    at a time). Every
    quote outside a string opens one, in JSON as here, so the scan splits strings as JSON does."""
    spans, pos, text = [], 0, 0
    with memoryview(body) as view:
        while (a := body.find(b'"', pos)) >= 0:
            b = body.find(b'"', a + 1)
            if b < 0:
                break  # unterminated: json.loads says so
            if body.find(b"\\", a + 1, b) >= 0:  # escapes: text, up to the first quote not escaped
                rest = _ESCAPED_REST.match(body, a + 1, a + 2 + max(0, max_text - text))
                b = rest.end() - 1 if rest else len(body) - 1
            elif b - a > 64 and _all_base64(view, a + 1, b):
                spans.append((a + 1, b))
                text += a - pos + MARK_BYTES
                pos = b + 1
                continue
            text += b + 1 - pos
            if text > max_text:
                raise _over(text, max_text)
            pos = b + 1
    text += len(body) - pos
    if text > max_text:
        raise _over(text, max_text)
    return spans


def split_images(body, max_text: int) -> tuple[bytes, str, list[tuple[int, int]]]:
    """Take the images (:func:`image_spans`) out of ``body``: ``(text, mark, spans)``, where ``text``
    is the body with the k-th image's string replaced by the JSON string ``mark + str(k)`` (``mark``
    holds a random nonce) and ``spans[k]`` is where its base64 lies in ``body``. Only ``text`` is
    parsed as JSON, so images never become Python strings, and a string with one non-BMP character
    (4 bytes a character once parsed) can only be text, at most ``max_text`` bytes (413 past it)."""
    spans = image_spans(body, max_text)
    nonce = secrets.token_hex(8)
    parts, pos = [], 0
    for k, (a, b) in enumerate(spans):
        parts += [body[pos : a - 1], f'"\\u0000{nonce}:{k}"'.encode()]
        pos = b + 1
    parts.append(body[pos:])
    return b"".join(parts), f"\x00{nonce}:", spans


def _restore(value, mark: str, strings: dict[int, str]):
    """``value`` (a prompt or metadata) with every placeholder (``mark`` + k), key or value, put back as
    the base64 text it replaced; iterative, as metadata may nest as deep as JSON allows."""
    put_back = lambda x: strings[int(x[len(mark) :])] if isinstance(x, str) and x.startswith(mark) else x  # noqa: E731
    value, todo = put_back(value), []
    todo.append(value)
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            items = [(put_back(k), put_back(v)) for k, v in node.items()]
            node.clear()
            node.update(items)
        elif isinstance(node, list):
            node[:] = map(put_back, node)
        else:
            continue
        todo.extend(node.values() if isinstance(node, dict) else node)
    return value


def parse_score_request(
    body, max_pixels: int, max_values: int = 100_000, max_text: int = 1 << 20
) -> ScoreRequest:
    """JSON body → :class:`ScoreRequest`; ``ServeError`` 400 (malformed, nested too deep) or 413 (an
    image too large, more than ``max_values`` JSON values, or more than ``max_text`` bytes besides the
    images). Memory beside the body: its PNG bytes (¾ of their base64), and at most 10 × ``max_text``
    and 150 bytes a JSON value for the rest (docs/rewards.md, "Limits and memory")."""
    values = json_values_bound(body)
    if values > max_values:
        raise ServeError(
            413,
            f"body holds up to {values} JSON values, over max_json_values {max_values} (images, prompts "
            "and small metadata need far fewer)",
        )
    text, mark, spans = split_images(body, max_text)
    try:
        req = json.loads(text)
    except RecursionError:
        raise ServeError(400, "body is not JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ServeError(400, f"body is not JSON: {_json_fault(exc, mark, spans)}") from None
    del text
    images, prompts, metadata = _shape(req)
    placed = {int(x[len(mark) :]) for x in images if isinstance(x, str) and x.startswith(mark)}
    if len(placed) < len(spans):  # long base64 strings in prompts or metadata: put back
        strings = {k: bytes(body[a:b]).decode("ascii") for k, (a, b) in enumerate(spans) if k not in placed}
        prompts = [_restore(x, mark, strings) for x in prompts]
        metadata = [_restore(x, mark, strings) for x in metadata]
    _check_items("prompts", prompts, str, "a string")
    _check_items("metadata", metadata, dict, "an object")
    pngs, sizes = [], []
    with memoryview(body) as view:
        for k, x in enumerate(images):
            placeholder = isinstance(x, str) and x.startswith(mark)
            a, b = spans[int(x[len(mark) :])] if placeholder else (0, 0)
            try:
                png, size = _png(view[a:b] if placeholder else x, max_pixels)
            except ServeError as exc:
                raise ServeError(exc.status, f"images[{k}]: {exc}") from None
            if sizes and size != sizes[0]:
                raise ServeError(
                    400,
                    f"images[{k}] is {_wxh(size)}, images[0] {_wxh(sizes[0])}: "
                    "a request's images must share one size",
                )
            pngs.append(png)
            sizes.append(size)
    return ScoreRequest(pngs, sizes[0] if sizes else None, prompts, metadata)


def _wxh(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def _json_type(value) -> str:
    """The JSON name of a parsed value's type (``object``, ``array``, ``string``, ...)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def _check_items(field: str, values: list, kind: type, what: str) -> None:
    """``ServeError`` 400 naming the first item of ``values`` that is not a ``kind`` (``what``)."""
    for i, value in enumerate(values):
        if not isinstance(value, kind):
            raise ServeError(400, f"{field}[{i}] must be {what}, got {_json_type(value)}")


def _json_fault(exc: ValueError, mark: str, spans: list[tuple[int, int]]) -> str:
    """What :func:`json.loads` found wrong with the body's text, and where in the *body*: the text
    holds a short placeholder for each image (:func:`split_images`), so its positions are moved by
    the length each image's string had (images hold no newline: lines are the body's)."""
    if isinstance(exc, UnicodeDecodeError):  # json.loads decodes bytes first: a position in bytes
        doc, pos, what = exc.object, exc.start, f"not UTF-8 ({exc.reason})"
    elif isinstance(exc, json.JSONDecodeError):
        doc, pos, what = exc.doc, exc.pos, exc.msg
    else:
        return str(exc)
    newline = b"\n" if isinstance(doc, bytes) else "\n"
    line_start = doc.rfind(newline, 0, pos) + 1
    shift, line_shift = _image_growth(doc, pos, line_start, mark, spans)
    line, column = doc.count(newline, 0, pos) + 1, pos - line_start + line_shift + 1
    unit = "byte" if isinstance(doc, bytes) else "character"
    return f"{what} at line {line} column {column} ({unit} {pos + shift} of the body)"


def _image_growth(doc, pos: int, line_start: int, mark: str, spans) -> tuple[int, int]:
    """How much longer the body is than the parsed text ``doc`` (str or bytes) before ``pos``: the
    images' strings less their placeholders, in all and since ``line_start``."""
    prefix = f'"\\u0000{mark[1:]}'  # a placeholder as JSON text, up to its index
    prefix = prefix.encode() if isinstance(doc, bytes) else prefix
    shift = line_shift = 0
    i = doc.find(prefix)
    while 0 <= i < pos:
        end = doc.find(prefix[:1], i + len(prefix))  # its closing quote
        a, b = spans[int(doc[i + len(prefix) : end])]
        grew = (b - a + 2) - (end + 1 - i)  # the image's string, quotes included, less its placeholder
        shift += grew
        line_shift += grew if i >= line_start else 0
        i = doc.find(prefix, end)
    return shift, line_shift


BODY_SHAPE = '{"images": [base64 PNG, ...], "prompts": [string, ...], "metadata": [object, ...] (optional)}'


def _shape(req) -> tuple[list, list, list]:
    """``(images, prompts, metadata)`` of a parsed body; ``ServeError`` 400 if its shape is wrong."""
    if not isinstance(req, dict):
        raise ServeError(400, f"body must be a JSON object {BODY_SHAPE}, got {_json_type(req)}")
    unknown = [k for k in req if k not in ("images", "prompts", "metadata")]
    if unknown:
        names = ", ".join(repr(k if len(k) <= 40 else k[:37] + "...") for k in unknown[:3])
        raise ServeError(400, f"unknown field {names} in the body; it takes {BODY_SHAPE}")
    missing = [k for k in ("images", "prompts") if k not in req]
    if missing:
        raise ServeError(400, f"the body lacks {' and '.join(map(repr, missing))}; it takes {BODY_SHAPE}")
    images, prompts = req["images"], req["prompts"]
    metadata = req.get("metadata", [{} for _ in prompts] if isinstance(prompts, list) else None)
    for field, value in (("images", images), ("prompts", prompts), ("metadata", metadata)):
        if not isinstance(value, list):
            raise ServeError(400, f"{field} must be an array, got {_json_type(value)}")
    if not len(images) == len(prompts) == len(metadata):
        counts = f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata"
        raise ServeError(400, f"{counts}: must match")
    return images, prompts, metadata


def decode_pngs(pngs: list[bytes], first: int = 0) -> np.ndarray:
    """PNG files of one size → ``(B, H, W, 3)`` uint8 pixels; ``ServeError`` 400 naming the image
    (``images[first + j]``) if corrupt or not one of :data:`EXACT_RAWMODES` (checked again where the
    pixels are decoded)."""
    from PIL import Image

    arrays = []
    for j, png in enumerate(pngs):
        try:
            with Image.open(io.BytesIO(png)) as img:
                _check_layout(img)
                arrays.append(np.asarray(img.convert("RGB")))
        except ServeError as exc:
            raise ServeError(exc.status, f"images[{first + j}]: {exc}") from None
        except Exception as exc:  # corrupt pixel data that passed the checksums
            raise ServeError(
                400, f"images[{first + j}]: undecodable image: {type(exc).__name__}: {exc}"
            ) from None
    return np.stack(arrays)
