"""GenEval's detector: Mask2Former instance segmentation over COCO's 80 classes and a CLIP ViT-L/14
zero-shot colour classifier on each object's masked crop, both from local weights (nothing is downloaded).

Pipeline (:class:`Mask2FormerDetector`), per image of ``(B, 3, H, W)`` in [0, 1]:

1. Preprocess in torch (:func:`prepare`): resize keeping the aspect ratio so that the short side is
   ``shortest_edge`` and the long side at most ``longest_edge`` (mmcv's rounding), bilinear; normalise
   with ImageNet's mean/std; pad bottom/right to a multiple of ``size_divisor`` with grey 128/255.
   Settings from ``model_dir/preprocessor_config.json`` when present (``size``, ``max_size``,
   ``size_divisor``, ``resample``, ``image_mean``/``image_std``), else GenEval's mmdet test pipeline:
   800 / 1333, divisor 32. ``image_size`` overrides the short side. GenEval's pipeline (mmdet 2.x
   ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``) is exactly these defaults; a transformers
   checkpoint's own ``preprocessor_config.json`` may ask for a smaller size (transformers' own
   post-processing assumes 384): pass ``image_size: 800`` to match GenEval. Differences: the input is a
   float tensor, not a uint8 PNG (no quantisation); transformers' processor would stretch to the divisor
   instead of padding.
2. Mask2Former (``transformers``' ``Mask2FormerForUniversalSegmentation``, in ``dtype``) → class logits
   ``(Q, C+1)`` and mask logits ``(Q, H/4, W/4)``; the rest in float32.
3. Instances (:func:`instances`), as mmdet's ``MaskFormerFusionHead.instance_postprocess`` (and
   transformers' ``post_process_instance_segmentation``, whose score formula is the same, not reused:
   it assumes unpadded 384 × 384 inputs and binarises before resizing): the top 100
   (query, class) pairs of the softmax without the no-object class (a query may give two classes), mask
   logits upsampled bilinearly to the padded input, cropped to the resized image, upsampled to the
   image (mmdet's ``rescale``), binary mask = logit > 0 (sigmoid > 0.5), score = class probability ×
   mean mask probability inside the binary mask, box = the mask's tight box ``(x0, y0, x1, y1)`` in
   pixels with exclusive x1/y1 (mmdet's ``mask2bbox``; GenEval's boxes are these too). Empty masks and
   scores below :data:`MIN_SCORE` are dropped; the 0.3 / 0.9 thresholds, the 16-per-class cap and the
   ordering are the rule engine's (:func:`.rules.visible`). No NMS (GenEval's ``max_overlap`` is 1).
4. Colours (GenEval's ``color_classification``): the object's box cropped from the image with the pixels
   outside its mask set to grey ``#999`` (:data:`BACKGROUND`; GenEval composites then crops, which is
   the same pixels), CLIP's preprocessing (short side 224 bicubic, centre crop, CLIP normalisation),
   the L2-normalised image embedding against one text embedding per colour: the mean of the normalised
   embeddings of :data:`TEMPLATES`, renormalised (clip_benchmark's ``zero_shot_classifier``); colour =
   argmax cosine. GenEval uses open_clip's ``ViT-L-14`` ``openai`` weights; transformers'
   ``openai/clip-vit-large-patch14`` holds the same weights.

Weights (save them once where the hub is reachable; here ``local_files_only``):
``Mask2FormerForUniversalSegmentation.from_pretrained("facebook/mask2former-swin-small-coco-instance")``
and its ``AutoImageProcessor`` → ``.save_pretrained(model_dir)`` (safetensors); ``CLIPModel`` and its
tokenizer/processor from ``openai/clip-vit-large-patch14`` → ``clip_dir``. Then ``--reward geneval
--reward_options '{"geneval": {"model_dir": "...", "clip_dir": "...", "image_size": 800}}'``. The label
names (``config.id2label``) must be COCO's as GenEval spells them (:data:`.metadata.COCO_CLASSES`).
The transformers Swin-S checkpoint is Facebook's Mask2Former release, not the checkpoint mmdetection
trained and GenEval used (same architecture, 100 queries): expect GenEval scores close to, not equal to,
published ones.

GPU memory (estimated from parameter counts, not measured): Mask2Former Swin-S 68.7 M parameters and CLIP
ViT-L/14 427.6 M → about 2.0 GB of weights in float32 (1.0 GB in bfloat16), plus a few GB of activations
at ``batch_size`` 8 and 800-pixel inputs (the decoder's 100 masks at H/4 × W/4 per layer, and the kept
queries' masks at full resolution during post-processing, one image at a time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flowcredit.errors import UserError, reading
from flowcredit.models.diffusers_common import default_device
from flowcredit.tasks.geneval.metadata import COCO_CLASSES
from flowcredit.tasks.geneval.rules import COLORS, ColorFn, Found, Scene

REWARD = "geneval"
BACKGROUND = 153 / 255
"""GenEval's ``bgcolor`` ``#999``: the grey outside an object's mask in its colour crop."""
TEMPLATES = ("a photo of a {c} {object}", "a photo of a {c}-colored {object}", "a photo of a {c} object")
"""GenEval's colour prompts (``{c}`` a colour of :data:`.rules.COLORS`, ``{object}`` the class name)."""
MAX_PER_IMAGE = 100
"""(query, class) pairs kept per image before the mask score (mmdet's ``max_per_image``)."""
MIN_SCORE = 1e-3
"""Instances scoring below this are dropped (far below GenEval's 0.3 threshold)."""
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PAD = 128 / 255
"""mmdet's padding value (before normalisation) in GenEval's config."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Instance:
    """One detected instance: ``label`` index, ``score``, tight ``box`` (x0, y0, x1, y1) with exclusive
    x1/y1, and its binary ``mask`` inside the box ``(y1 - y0, x1 - x0)`` (CPU)."""

    label: int
    score: float
    box: tuple[int, int, int, int]
    mask: torch.Tensor


def preprocess_config(model_dir: Path, image_size: int | None = None) -> dict:
    """Resize/normalise settings from ``model_dir/preprocessor_config.json`` (GenEval's mmdet defaults
    for what it lacks); ``image_size`` overrides the short side."""
    path = model_dir / "preprocessor_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    size = cfg.get("size", 800)
    longest = cfg.get("max_size", 1333)
    if isinstance(size, dict):
        fixed = (size["height"], size["width"]) if "height" in size and "width" in size else None
        longest = size.get("longest_edge", longest)
        size = size.get("shortest_edge", 800)
    else:
        fixed = None
    if image_size is not None:
        size, fixed = int(image_size), None
    normalise = cfg.get("do_normalize", True)
    return {
        "resize": cfg.get("do_resize", True),
        "fixed": fixed,
        "shortest": int(size),
        "longest": int(longest) if longest else None,
        "divisor": int(cfg.get("size_divisor", 32) or 1),
        "mode": "bicubic" if cfg.get("resample", 2) == 3 else "bilinear",
        "mean": tuple(cfg.get("image_mean", IMAGENET_MEAN)) if normalise else (0.0,) * 3,
        "std": tuple(cfg.get("image_std", IMAGENET_STD)) if normalise else (1.0,) * 3,
    }


def resized_hw(h: int, w: int, cfg: dict) -> tuple[int, int]:
    """Size after the resize: fixed, or aspect kept with short side ``shortest`` and long side at most
    ``longest`` (mmcv's ``rescale_size``: scale = min of the two ratios, ``int(x · scale + 0.5)``)."""
    if not cfg["resize"]:
        return h, w
    if cfg["fixed"] is not None:
        return tuple(cfg["fixed"])
    scale = cfg["shortest"] / min(h, w)
    if cfg["longest"]:
        scale = min(scale, cfg["longest"] / max(h, w))
    return int(h * scale + 0.5), int(w * scale + 0.5)


def prepare(images: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, tuple[int, int]]:
    """``images (B, 3, H, W)`` in [0, 1] → normalised, padded ``pixels (B, 3, Hp, Wp)`` float32 and the
    resized size ``(h, w)`` inside the padding (see the module docstring)."""
    x = images.float()
    h, w = resized_hw(*x.shape[-2:], cfg)
    if (h, w) != tuple(x.shape[-2:]):
        x = F.interpolate(x, size=(h, w), mode=cfg["mode"], align_corners=False).clamp(0, 1)
    d = cfg["divisor"]
    hp, wp = -(-h // d) * d, -(-w // d) * d
    x = F.pad(x, (0, wp - w, 0, hp - h), value=PAD)
    mean = torch.tensor(cfg["mean"], device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(cfg["std"], device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std, (h, w)


def mask_upsampler(padded: tuple[int, int], resized: tuple[int, int], out: tuple[int, int]):
    """``(K, h4, w4)`` mask logits → ``(K, H, W)`` float32 as mmdet: bilinear to the ``padded`` input,
    crop the ``resized`` image, bilinear to the image size ``out``."""

    def up(logits: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(logits[None].float(), size=padded, mode="bilinear", align_corners=False)
        x = x[..., : resized[0], : resized[1]]
        return F.interpolate(x, size=out, mode="bilinear", align_corners=False)[0]

    return up


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Tight boxes ``(K, 4)`` long ``(x0, y0, x1, y1)`` of non-empty ``(K, H, W)`` bool masks, x1/y1
    exclusive (mmdet's ``mask2bbox``)."""
    cols, rows = masks.any(dim=1), masks.any(dim=2)  # (K, W), (K, H)

    def first_last(any_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = any_.shape[1]
        return any_.int().argmax(dim=1), n - any_.flip(1).int().argmax(dim=1)

    (x0, x1), (y0, y1) = first_last(cols), first_last(rows)
    return torch.stack([x0, y0, x1, y1], dim=1)


def instances(
    class_logits: torch.Tensor,
    mask_logits: torch.Tensor,
    upsample=None,
    max_per_image: int = MAX_PER_IMAGE,
    min_score: float = MIN_SCORE,
) -> list[Instance]:
    """One image's instances, highest score first: ``class_logits (Q, C+1)`` (last = no object),
    ``mask_logits (Q, h, w)``, ``upsample`` (``(K, h, w) → (K, H, W)``; none: masks at ``h, w``).

    The top ``max_per_image`` (query, class) probabilities; per pair, mask = upsampled logit > 0,
    score = probability × mean sigmoid inside the mask; empty masks and scores < ``min_score`` dropped.
    """
    probs = torch.softmax(class_logits.float(), dim=-1)[:, :-1]  # (Q, C)
    n_classes = probs.shape[1]
    top, flat = probs.flatten().topk(min(max_per_image, probs.numel()))  # (K,)
    uniq, inverse = torch.unique(flat // n_classes, return_inverse=True)  # (U,), (K,)
    logits = mask_logits[uniq].float()
    logits = upsample(logits) if upsample is not None else logits  # (U, H, W)
    binary = logits > 0
    area = binary.flatten(1).sum(1)  # (U,)
    mask_score = (logits.sigmoid() * binary).flatten(1).sum(1) / (area + 1e-6)
    scores = top * mask_score[inverse]  # (K,)
    keep = ((area[inverse] > 0) & (scores >= min_score)).tolist()
    order = [k for k in torch.argsort(-scores, stable=True).tolist() if keep[k]]
    boxes, binary = mask_boxes(binary).tolist(), binary.cpu()
    scores, inverse, labels = scores.tolist(), inverse.tolist(), (flat % n_classes).tolist()
    out = []
    for k in order:
        x0, y0, x1, y1 = boxes[inverse[k]]
        mask = binary[inverse[k], y0:y1, x0:x1].clone()
        out.append(Instance(labels[k], scores[k], (x0, y0, x1, y1), mask))
    return out


def masked_crop(image: torch.Tensor, mask: torch.Tensor, box, background: float = BACKGROUND):
    """``image (3, H, W)`` cropped to ``box`` (x0, y0, x1, y1), the pixels where ``mask (y1-y0, x1-x0)``
    is false set to ``background`` → ``(3, y1-y0, x1-x0)``."""
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    crop = image[:, y0:y1, x0:x1].float()
    return torch.where(mask.to(crop.device)[None], crop, torch.full_like(crop, background))


def color_classifier(clip, name: str) -> torch.Tensor:
    """``(len(COLORS), D)``: per colour the renormalised mean of the normalised text embeddings of
    :data:`TEMPLATES` for the class ``name``."""
    texts = [t.format(c=c, object=name) for c in COLORS for t in TEMPLATES]
    emb = clip.text_embeds(texts).view(len(COLORS), len(TEMPLATES), -1)  # (10, 3, D)
    return F.normalize(emb.mean(dim=1), dim=-1)


def crop_embeds(clip, crops: list[torch.Tensor]) -> torch.Tensor:
    """Crops ``(3, h_i, w_i)`` in [0, 1] → L2-normalised CLIP image embeddings ``(N, D)`` float32, each
    preprocessed alone (sizes differ), one forward (``clip.image_embeds`` of a list)."""
    return clip.image_embeds(list(crops))


def _directory(option: str, path) -> Path:
    """``path`` as an existing directory; ``UserError`` naming the option and path otherwise."""
    p = Path(path).expanduser() if path is not None else None
    if p is None or not p.is_dir():
        raise UserError(
            f"reward {REWARD!r}: option {option!r} = {str(path)!r} is not an existing directory "
            "(weights are never downloaded; save them there first, see docs/geneval.md)"
        )
    return p


class Mask2FormerDetector:
    """GenEval's detector (see the module docstring): ``(images, metas) -> [(Scene, ColorFn)]``.

    ``clip_loader(reward, clip_dir, device, dtype)`` loads the colour classifier's CLIP: an object with
    ``text_embeds(texts) -> (N, D)`` and ``image_embeds(list of (3, h, w)) -> (N, D)``, L2-normalised
    (the registry passes :func:`flowcredit.rewards.clip.load_clip`; this module does not import rewards).
    """

    def __init__(
        self,
        *,
        model_dir,
        clip_dir,
        device=None,
        dtype="float32",
        batch_size=8,
        image_size=None,
        clip_loader=None,
    ):
        if dtype not in DTYPES:
            raise UserError(
                f"reward {REWARD!r}: option 'dtype' must be one of {sorted(DTYPES)}, got {dtype!r}"
            )
        if clip_loader is None:
            raise UserError(
                f"reward {REWARD!r}: the mask2former detector needs a CLIP loader: build the reward with "
                "flowcredit.rewards.get_reward('geneval', ...)"
            )
        path = _directory("model_dir", model_dir)
        _directory("clip_dir", clip_dir)
        self.device = device or str(default_device())  # cuda:LOCAL_RANK: one GPU per rank
        self.model = _load_model(path, self.device, DTYPES[dtype])
        self.classes = _check_classes(self.model.config, path)
        self.clip = clip_loader(REWARD, clip_dir, self.device, dtype)
        with reading(f"reward {REWARD!r}: option 'model_dir'", path, "preprocessor_config.json"):
            self.pre = preprocess_config(path, image_size)
        self.batch_size, self.dtype = int(batch_size), DTYPES[dtype]
        self._classifiers: dict[str, torch.Tensor] = {}

    def detect(self, images: torch.Tensor) -> list[list[Instance]]:
        """``images (B, 3, H, W)`` in [0, 1] → each image's instances, in chunks of ``batch_size``."""
        out = []
        for i in range(0, images.shape[0], self.batch_size):
            chunk = images[i : i + self.batch_size].to(self.device)
            pixels, resized = prepare(chunk, self.pre)
            with torch.no_grad():
                res = self.model(pixel_values=pixels.to(self.dtype))
            up = mask_upsampler(tuple(pixels.shape[-2:]), resized, tuple(images.shape[-2:]))
            for cls, masks in zip(res.class_queries_logits, res.masks_queries_logits):
                out.append(instances(cls, masks, up))
        return out

    def __call__(self, images: torch.Tensor, metas: list[dict]) -> list[tuple[Scene, ColorFn]]:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"geneval detector wants images (B, 3, H, W), got {tuple(images.shape)}")
        out = []
        for image, found in zip(images, self.detect(images)):
            scene: Scene = {}
            for i, inst in enumerate(found):
                box = tuple(float(v) for v in inst.box)
                scene.setdefault(self.classes[inst.label], []).append(Found(box, inst.score, index=i))
            out.append((scene, self._color_fn(image, found)))
        return out

    def classifier(self, name: str) -> torch.Tensor:
        """The cached colour classifier of class ``name`` (:func:`color_classifier`)."""
        if name not in self._classifiers:
            self._classifiers[name] = color_classifier(self.clip, name)
        return self._classifiers[name]

    def colors(self, name: str, crops: list[torch.Tensor]) -> list[str]:
        """Colour names of the masked ``crops`` of objects of class ``name`` (argmax cosine)."""
        if not crops:
            return []
        cos = crop_embeds(self.clip, crops) @ self.classifier(name).T  # (N, 10)
        return [COLORS[int(j)] for j in cos.argmax(dim=1)]

    def _color_fn(self, image: torch.Tensor, found: list[Instance]) -> ColorFn:
        def colors(name: str, group: list[Found]) -> list[str]:
            picked = [found[f.index] for f in group]
            return self.colors(name, [masked_crop(image, p.mask, p.box) for p in picked])

        return colors


def _load_model(path: Path, device: str, dtype: torch.dtype):
    """Mask2Former from local safetensors in ``path``; errors name the option ``model_dir``."""
    from transformers import Mask2FormerForUniversalSegmentation

    if not any(path.glob("*.safetensors")):
        raise UserError(
            f"reward {REWARD!r}: option 'model_dir' = {str(path)!r} holds no *.safetensors weights "
            "(save the model there with save_pretrained; see flowcredit/tasks/geneval/mask2former.py)"
        )
    try:
        model = Mask2FormerForUniversalSegmentation.from_pretrained(
            path, local_files_only=True, use_safetensors=True, dtype=dtype
        )
    except (OSError, ValueError) as exc:
        msg = " ".join(str(exc).split())
        raise UserError(
            f"reward {REWARD!r}: option 'model_dir' = {str(path)!r}: cannot load: {msg}"
        ) from None
    return model.to(device).eval().requires_grad_(False)


def _check_classes(config, path: Path) -> tuple[str, ...]:
    """The label names in id order; ``UserError`` naming ``model_dir`` unless all are COCO's."""
    names = tuple(config.id2label[i] for i in range(len(config.id2label)))
    unknown = [n for n in names if n not in COCO_CLASSES]
    if unknown:
        raise UserError(
            f"reward {REWARD!r}: option 'model_dir' = {str(path)!r}: labels {unknown[:5]} are not COCO "
            "classes as GenEval names them (flowcredit.tasks.geneval.metadata.COCO_CLASSES)"
        )
    return names
