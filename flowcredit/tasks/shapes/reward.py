"""ShapeEval reward: an exact programmatic scorer of images against prompt metadata.

Pipeline (numpy/scipy, vectorised over the batch; details and failure modes in docs/shapeeval.md):

1. **Pixel classes.** Each pixel ``p`` is projected on every segment ``bg -> c_k`` (``BACKGROUND`` to
   ``PALETTE[k]``: the colours an anti-aliased edge of colour k takes),
   ``a_k = clip(<p - bg, c_k - bg> / |c_k - bg|², 0, 1)``, residual ``r_k = |p - bg - a_k (c_k - bg)|``.
   With ``k* = argmin r_k`` the pixel is *unknown* if ``r_k* > UNKNOWN_RESIDUAL``, colour ``k*`` if
   ``a_k* >= 0.5``, else background. (The nearest palette colour in RGB would turn red/white edge
   pixels yellow.)
2. **Components.** 8-connected components of every class (unknown included), one
   ``scipy.ndimage.label`` call for the whole batch; components under ``MIN_AREA_FRAC`` of the image
   are noise and dropped.
3. **Shapes** from sub-pixel features of each component's soft mask (``find_components``): fill of
   its soft extents (square 1, circle π/4, triangle 1/2) and vertical skewness (triangle -0.57,
   others 0). Unknown-colour components and anything unclassifiable are *blobs*.
4. **Requirements** per category, each a credit in [0, 1] (``_requirements``); ``soft`` is their
   mean, ``strict`` is 1 iff all are exactly 1.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from flowcredit.tasks.shapes.prompts import CATEGORIES, validate_meta
from flowcredit.tasks.shapes.scene import BACKGROUND, PALETTE, SHAPES, relation_holds

UNKNOWN_RESIDUAL = 0.25
"""A pixel farther than this (RGB, [0, 1] units) from every background-to-colour segment is unknown."""
MIN_AREA_FRAC = 12 / 1024
"""Components smaller than this fraction of the image (12 pixels at 32x32; the smallest generated
object covers about 24) are ignored as noise."""
MAX_EXTENT = 0.6
"""Components wider or taller than this fraction of the image are blobs (generated objects: <= 0.36),
so painting the whole canvas one colour is not "a square"."""
SQUARE_FILL = 0.92
"""Symmetric components with a soft fill (see ``find_components``) >= this are squares, below circles."""
SHAPE_LEVEL = ("colors", "color_attr")
"""Categories that also credit each object's shape in any colour (colour is the tested attribute)."""

_COLORS = np.stack(list(PALETTE.values()))  # (K, 3)
_COLOR_IDS = {name: i for i, name in enumerate(PALETTE)}
_SHAPE_IDS = {name: i for i, name in enumerate(SHAPES)}
UNKNOWN = len(PALETTE)  # pixel / component class of unexplained colours
BLOB = -1  # shape id of a component that is no known shape


def _to_numpy(images) -> np.ndarray:
    """Tensor or array (B, 3, H, W) -> float32 numpy array."""
    if hasattr(images, "detach"):
        images = images.detach().float().cpu().numpy()
    x = np.asarray(images, dtype=np.float32)
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W), got shape {x.shape}")
    return x


def _pixel_classes(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixel classes (B, H, W) int8 (see :func:`classify_pixels`) and the mixing coefficients
    ``alpha`` (B, H, W, K) float32 of every palette colour against the background."""
    x = images.transpose(0, 2, 3, 1) - BACKGROUND  # (B, H, W, 3)
    d = _COLORS - BACKGROUND  # (K, 3)
    dd = (d * d).sum(1)  # (K,)
    xd = x @ d.T  # (B, H, W, K)
    alpha = np.clip(xd / dd, 0.0, 1.0)
    resid = (x * x).sum(-1, keepdims=True) - 2 * alpha * xd + alpha * alpha * dd  # squared, (B, H, W, K)
    k = resid.argmin(-1)[..., None]
    r = np.take_along_axis(resid, k, -1)[..., 0]
    a = np.take_along_axis(alpha, k, -1)[..., 0]
    cls = np.where(a >= 0.5, k[..., 0], -1)
    return np.where(r > UNKNOWN_RESIDUAL**2, UNKNOWN, cls).astype(np.int8), alpha


def classify_pixels(images) -> np.ndarray:
    """Pixel classes of images (B, 3, H, W) in [0, 1]: (B, H, W) int8, -1 background, k < K palette
    colour ``list(PALETTE)[k]``, K = ``UNKNOWN``."""
    return _pixel_classes(_to_numpy(images))[0]


def _classify_shapes(fill, skew, aspect, extent, color) -> np.ndarray:
    """Shape ids (n,) from the component features of :func:`find_components` and its colour class."""
    ok = (aspect <= 1.3) & (aspect >= 1 / 1.3) & (extent <= MAX_EXTENT) & (color != UNKNOWN)
    level = ok & (np.abs(skew) < 0.15)  # vertically symmetric
    square = level & (fill >= SQUARE_FILL) & (fill < 1.1)
    circle = level & (fill >= 0.65) & (fill < SQUARE_FILL)
    triangle = ok & (skew <= -0.2) & (skew > -1.0) & (fill >= 0.4) & (fill < 0.92)  # mass sinks
    shape = np.full(fill.shape, BLOB)
    shape[circle] = _SHAPE_IDS["circle"]
    shape[square] = _SHAPE_IDS["square"]
    shape[triangle] = _SHAPE_IDS["triangle"]
    return shape


def _label(cls: np.ndarray, min_area: int) -> tuple[np.ndarray, np.ndarray]:
    """Connected components of every class, small ones dropped.

    Returns ``labels`` (K + 1, B, H, W) int32 with the kept components numbered 1 .. n (0 elsewhere;
    plane k holds class k, UNKNOWN last) and their pixel counts ``area`` (n,).
    """
    planes = cls[None] == np.arange(UNKNOWN + 1, dtype=np.int8)[:, None, None, None]  # (K + 1, B, H, W)
    structure = np.zeros((3, 3, 3, 3), dtype=bool)
    structure[1, 1] = True  # 8-connected within an image plane, never across classes or images
    labels, n = ndimage.label(planes, structure)
    area = np.bincount(labels.ravel(), minlength=n + 1)
    keep = area >= min_area
    keep[0] = False
    remap = np.zeros(n + 1, dtype=np.int32)
    remap[keep] = np.arange(1, keep.sum() + 1)
    return remap[labels], area[keep]


def find_components(images) -> dict[str, np.ndarray]:
    """Detected objects of a batch (B, 3, H, W) in [0, 1], as flat arrays over all kept components.

    A component's *soft mask* is its pixels plus the adjacent background ring, each weighted by its
    coverage ``alpha`` of the component's colour, so the features below are sub-pixel accurate and
    nearly blur-invariant. With row sums ``R(y)`` and column sums ``C(x)`` of the soft mask:
    ``fill = sum(R) / (max R * max C)`` (square 1, circle π/4, triangle 1/2), ``skew`` = skewness of
    ``R`` (triangle -0.57, square and circle 0), ``aspect = max R / max C``, ``extent = max(max R,
    max C) / image side``.

    Returns ``image`` (n,) batch index, ``color`` (n,) class (``UNKNOWN`` for unexplained colours),
    ``shape`` (n,) id into ``SHAPES`` or ``BLOB``, ``cx``, ``cy`` (n,) soft centroids in pixels (x
    right, y down), ``area`` (n,) pixel count, ``fill``, ``skew``, ``aspect``, ``extent`` (n,), the box
    ``x0, y0, x1, y1`` (n,) (pixel edges of the rows and columns the component covers by at least half
    a pixel); sorted by image.
    """
    x = _to_numpy(images)
    _, _, H, W = x.shape
    cls, alpha = _pixel_classes(x)
    labels, area = _label(cls, max(1, round(MIN_AREA_FRAC * H * W)))
    n = len(area)
    ring = ndimage.maximum_filter(labels[:UNKNOWN], size=(1, 1, 3, 3)) * (cls == -1)
    member = labels.copy()
    member[:UNKNOWN] += ring  # background pixels next to a colour component join it
    idx = np.flatnonzero(member)
    comp = member.ravel()[idx] - 1
    k, b, y, xx = np.unravel_index(idx, member.shape)
    alpha1 = np.concatenate([alpha, np.ones_like(alpha[..., :1])], -1)  # unknown pixels weigh 1
    wgt = alpha1[b, y, xx, k].astype(np.float64)
    rows = np.bincount(comp * H + y, wgt, n * H).reshape(n, H)  # (n, H) soft width of each row
    cols = np.bincount(comp * W + xx, wgt, n * W).reshape(n, W)  # (n, W) soft height of each column
    mass = rows.sum(1) + 1e-9
    cy = rows @ np.arange(H) / mass
    var = rows @ np.arange(H) ** 2 / mass - cy**2
    third = (rows * (np.arange(H) - cy[:, None]) ** 3).sum(1) / mass
    image, color = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    image[comp], color[comp] = b, k
    out = {
        "image": image,
        "color": color,
        "cx": cols @ np.arange(W) / mass + 0.5,
        "cy": cy + 0.5,
        "area": area,
        "fill": mass / (rows.max(1) * cols.max(1) + 1e-9),
        "skew": third / np.maximum(var, 1e-9) ** 1.5,
        "aspect": rows.max(1) / (cols.max(1) + 1e-9),
        "extent": np.maximum(rows.max(1), cols.max(1)) / max(H, W),
    }
    out["shape"] = _classify_shapes(out["fill"], out["skew"], out["aspect"], out["extent"], out["color"])
    out |= _boxes(rows, cols)
    order = np.argsort(out["image"], kind="stable")
    return {key: v[order] for key, v in out.items()}


def _boxes(rows: np.ndarray, cols: np.ndarray) -> dict[str, np.ndarray]:
    """Boxes from the soft row widths ``rows (n, H)`` and column heights ``cols (n, W)``."""
    out = {}
    for lo, hi, sums in (("y0", "y1", rows), ("x0", "x1", cols)):
        covered = sums >= 0.5  # (n, L)
        out[lo] = np.argmax(covered, axis=1).astype(np.float64)
        out[hi] = (sums.shape[1] - np.argmax(covered[:, ::-1], axis=1)).astype(np.float64)
    return out


def detect_objects(images) -> list[list[dict]]:
    """Per image, the detected objects as dicts ``{"color", "shape", "cx", "cy", "area"}`` (names;
    ``"unknown"`` colour, ``"blob"`` shape). For inspection and tests; scoring uses the arrays."""
    comps = find_components(images)
    colors, shapes = [*PALETTE, "unknown"], list(SHAPES)
    out: list[list[dict]] = [[] for _ in range(_to_numpy(images).shape[0])]
    for i in range(len(comps["image"])):
        s = int(comps["shape"][i])
        out[int(comps["image"][i])].append(
            {
                "color": colors[int(comps["color"][i])],
                "shape": "blob" if s == BLOB else shapes[s],
                "cx": float(comps["cx"][i]),
                "cy": float(comps["cy"][i]),
                "area": int(comps["area"][i]),
            }
        )
    return out


def _count_credit(found: int, wanted: int) -> float:
    """1 for the exact count, ``min / max`` otherwise (0 when nothing is found)."""
    return min(found, wanted) / max(found, wanted)


def _requirements(meta: dict, c: dict[str, np.ndarray]) -> list[float]:
    """Credits in [0, 1] for one image's components ``c`` (arrays as in ``find_components``).

    Per object spec: the count of matching colour+shape objects (``_count_credit``); for ``colors``
    and ``color_attr`` also the count of the shape in any colour; for ``position`` the relation
    between the largest matching objects (0 if either is missing); finally *no extras*:
    ``1 / (1 + #objects matching no spec)``, blobs included, given only when some other credit is
    positive (so blank or noise images score 0).
    """
    objs = meta["objects"]
    ids = [(_COLOR_IDS[o["color"]], _SHAPE_IDS[o["shape"]]) for o in objs]
    match = [(c["color"] == ci) & (c["shape"] == si) for ci, si in ids]
    found = [int(m.sum()) for m in match]
    reqs = []
    if meta["category"] in SHAPE_LEVEL:
        reqs += [_count_credit(int((c["shape"] == si).sum()), o["count"]) for (_, si), o in zip(ids, objs)]
    reqs += [_count_credit(f, o["count"]) for f, o in zip(found, objs)]
    rel = meta.get("relation")
    if rel is not None:
        ma, mb = match[rel["a"]], match[rel["b"]]
        ok = False
        if ma.any() and mb.any():
            ia = np.flatnonzero(ma)[np.argmax(c["area"][ma])]
            ib = np.flatnonzero(mb)[np.argmax(c["area"][mb])]
            ok = relation_holds(rel["type"], (c["cx"][ia], c["cy"][ia]), (c["cx"][ib], c["cy"][ib]))
        reqs.append(float(ok))
    n_extra = len(c["color"]) - sum(found)
    reqs.append(1.0 / (1 + n_extra) if max(reqs) > 0 else 0.0)
    return reqs


def score_images(images, metas: list[dict]) -> dict:
    """Scores images (B, 3, H, W) in [0, 1] (tensor or array) against metadata ``metas`` (B dicts).

    Returns ``{"soft": (B,) float64 mean credit, "strict": (B,) float64 in {0, 1}, "category": [str]}``.
    """
    x = _to_numpy(images)
    if len(metas) != x.shape[0]:
        raise ValueError(f"{x.shape[0]} images but {len(metas)} metadata dicts")
    comps = find_components(x)
    bounds = np.searchsorted(comps["image"], np.arange(x.shape[0] + 1))
    soft, strict = np.zeros(len(metas)), np.zeros(len(metas))
    for i, meta in enumerate(metas):
        sl = slice(bounds[i], bounds[i + 1])
        reqs = _requirements(meta, {k: v[sl] for k, v in comps.items()})
        soft[i] = sum(reqs) / len(reqs)
        strict[i] = float(all(r == 1.0 for r in reqs))
    return {"soft": soft, "strict": strict, "category": [m["category"] for m in metas]}


def _checked_scores(images, prompts: list[str], metadata: list[dict]) -> dict:
    """:func:`score_images` after checking that every prompt has well-formed metadata."""
    if metadata is None or len(metadata) != len(prompts):
        n = "no" if metadata is None else len(metadata)
        raise ValueError(
            f"shapes reward needs one metadata dict per prompt: {len(prompts)} prompts, {n} dicts"
        )
    for prompt, meta in zip(prompts, metadata):
        if meta is None:
            raise ValueError(f"prompt {prompt!r}: ShapeEval metadata missing")
        validate_meta(meta, prompt)
    return score_images(images, metadata)


def shapes_reward(images, prompts: list[str], metadata: list[dict]):
    """The registered ``shapes`` reward: soft ShapeEval score, Tensor (B,) float32 on the images' device.

    Args:
        images: (B, 3, H, W) in [0, 1], tensor or array.
        prompts: B caption strings.
        metadata: B ShapeEval metadata dicts; each must be well-formed and describe its prompt
            (ValueError naming the prompt otherwise).
    """
    import torch

    soft = _checked_scores(images, prompts, metadata)["soft"]
    device = images.device if isinstance(images, torch.Tensor) else None
    return torch.as_tensor(soft, dtype=torch.float32, device=device)


def shapes_strict_reward(images, prompts: list[str], metadata: list[dict]):
    """The registered ``shapes_strict`` reward: 1 iff every requirement of the prompt holds exactly (the
    held-out pass/fail), else 0; Tensor (B,) float32. A surplus object fails the image outright,
    where ``shapes`` only divides its no-extras credit. Arguments as :func:`shapes_reward`."""
    import torch

    strict = _checked_scores(images, prompts, metadata)["strict"]
    device = images.device if isinstance(images, torch.Tensor) else None
    return torch.as_tensor(strict, dtype=torch.float32, device=device)


def evaluation_table(soft, strict, categories: list[str]) -> dict[str, dict[str, float]]:
    """GenEval-style summary: per category ``{"soft", "strict", "n"}`` means, and ``"overall"`` = the
    mean over the categories present (not over images)."""
    soft, strict = np.asarray(soft, dtype=np.float64), np.asarray(strict, dtype=np.float64)
    cats = np.asarray(categories)
    table: dict[str, dict[str, float]] = {}
    for cat in [c for c in CATEGORIES if c in set(categories)] + sorted(set(categories) - set(CATEGORIES)):
        m = cats == cat
        table[cat] = {"soft": float(soft[m].mean()), "strict": float(strict[m].mean()), "n": int(m.sum())}
    rows = list(table.values())
    table["overall"] = {
        "soft": float(np.mean([r["soft"] for r in rows])) if rows else float("nan"),
        "strict": float(np.mean([r["strict"] for r in rows])) if rows else float("nan"),
        "n": int(sum(r["n"] for r in rows)),
    }
    return table


def format_table(table: dict[str, dict[str, float]]) -> str:
    """Fixed-width text rendering of :func:`evaluation_table`."""
    lines = [f"{'category':<14}{'n':>6}{'soft':>8}{'strict':>8}"]
    for cat, r in table.items():
        lines.append(f"{cat:<14}{r['n']:>6d}{r['soft']:>8.3f}{r['strict']:>8.3f}")
    return "\n".join(lines)
