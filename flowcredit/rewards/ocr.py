"""OCR reward (Flow-GRPO's text-rendering task) with rapidocr instead of PaddleOCR.

Flow-GRPO's convention: the target is the text between the first pair of double quotes in the
prompt; target and recognised text lose their whitespace and are lower-cased; then

    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    reward = 1 - dist / len(target)                                  # in [0, 1]

Deviations from Flow-GRPO: (1) rapidocr's bundled PP-OCR ONNX models (ch+en) stand in for
PaddleOCR's ``lang="en"`` model; (2) all whitespace is removed, not only spaces; (3) recognised
lines are those rapidocr keeps (text score ≥ 0.5), joined in reading order; (4) the detector limits
the longer side to ``limit_side_len`` (512) instead of upscaling the shorter side to 736, and the
angle classifier is off: 3–10× faster on 256–512 px images, same texts (docs/rewards.md).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from flowcredit.rewards.errors import RewardInputError


def ocr_target(prompt: str) -> str:
    """The text between the first pair of double quotes, whitespace removed, lower-cased."""
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(f'the ocr reward needs a text in double quotes ("..."), prompt {prompt!r} has none')
    target = _normalise(parts[1])
    if not target:
        raise ValueError(
            f"the ocr reward needs a text in double quotes, prompt {prompt!r} quotes an empty one"
        )
    return target


def _targets(prompts: list[str]) -> list[str]:
    """Every prompt's target (:func:`ocr_target`); :class:`RewardInputError` naming the first without."""
    targets = []
    for i, prompt in enumerate(prompts):
        try:
            targets.append(ocr_target(prompt))
        except ValueError as exc:
            raise RewardInputError("prompts", i, str(exc)) from None
    return targets


def _normalise(text: str) -> str:
    return "".join(text.split()).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(recognised: str, target: str) -> float:
    """Flow-GRPO's score of recognised text against a normalised, non-empty target: in [0, 1]."""
    recognised = _normalise(recognised)
    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1.0 - dist / len(target)


@functools.lru_cache(maxsize=2)
def _engine(limit_side_len: int, threads: int, use_cls: bool):
    """One rapidocr engine per setting, built once per process (init ≈ 1 s)."""
    from rapidocr import RapidOCR

    return RapidOCR(
        params={
            "Det.limit_type": "max",
            "Det.limit_side_len": limit_side_len,
            "Global.use_cls": use_cls,
            "Global.log_level": "error",  # "no text detected" is a normal outcome here
            # one onnxruntime thread is faster than the default on small images (ecosystem-facts)
            "EngineConfig.onnxruntime.intra_op_num_threads": threads,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        }
    )


def recognise(engine, image: torch.Tensor) -> str:
    """All text rapidocr reads in one image ``(3, H, W)`` in [0, 1], lines joined without separator."""
    rgb = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    result = engine(np.ascontiguousarray(rgb[..., ::-1]))  # a raw ndarray is read as BGR
    return "".join(getattr(result, "txts", None) or ())


def ocr(*, limit_side_len: int = 512, threads: int = 1, use_cls: bool = False):
    """Factory of the ``ocr`` reward.

    Args:
        limit_side_len: the detector resizes images so that the longer side is at most this.
        threads: onnxruntime intra-op threads (1 is fastest on small images).
        use_cls: run the 180° text-angle classifier (off: generated text is upright).

    Returns:
        ``reward(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)`` float32 in [0, 1];
        a prompt without quoted text raises :class:`~flowcredit.rewards.RewardInputError` (a
        ``ValueError``) naming it.
    """
    engine = _engine(int(limit_side_len), int(threads), bool(use_cls))

    def reward(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"ocr reward: {images.shape[0]} images but {len(prompts)} prompts")
        targets = _targets(prompts)  # fail before any OCR work
        scores = [ocr_score(recognise(engine, img), t) for img, t in zip(images, targets)]
        return torch.tensor(scores, dtype=torch.float32)

    return reward
