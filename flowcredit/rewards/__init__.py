"""Rewards: ``reward(images (B, 3, H, W) in [0, 1], prompts: list[str], metadata: list[dict]) -> (B,)``.

Resolve one with :func:`get_reward` from a registry name (``REWARDS``), a dotted path
``"pkg.mod:fn"``, or a weighted mix ``"shapes=1.0,jpeg_compressibility=0.1"`` (also a dict); a mix
reports each component, so the trainer can log ``reward/<name>``.

Every ``REWARDS`` value is a *factory* ``(**options) -> reward_fn``, called once per :class:`Reward`
with that reward's entry of ``options`` (the config field ``reward_options``, JSON
``{"pickscore": {"model_dir": "/models/pickscore"}}``). Heavy rewards (OCR, CLIP models, the HTTP
client) are registered lazily: their module, and its transformers / rapidocr imports, load only when
the reward is built. An option the factory does not take, or a required one that is missing, is a
:class:`~flowcredit.errors.UserError` (a ``ValueError``) naming the reward and the option; so is a
weights path that is missing or unreadable (one line, exit status 2 from the CLI). A dotted path
names a reward function; if options are given for it, it is called as a factory
``fn(**options) -> reward_fn`` instead.

Video: a video model decodes to clips ``(B, F, 3, H, W)``. An image reward then scores every
``frame_stride``-th frame (frames ``0, k, 2k, …``) and the clip's reward is the mean over those frames;
a reward marked with :func:`video_reward` receives the whole clip instead.
"""

from __future__ import annotations

import importlib
import inspect
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from flowcredit.errors import UserError, one_line
from flowcredit.rewards.errors import RewardInputError, RewardOutputError

RewardFn = Callable[[torch.Tensor, list[str], list[dict]], torch.Tensor]
RewardFactory = Callable[..., RewardFn]


def _shapes(images, prompts, metadata):
    """ShapeEval's soft score; every sample needs ShapeEval metadata (``prompt``, ``category``,
    ``objects``; ``relation`` for ``position``), else :class:`RewardInputError` names it."""
    from flowcredit.rewards.metadata import check_shapes_metadata
    from flowcredit.tasks.shapes import shapes_reward

    check_shapes_metadata("shapes", prompts, metadata)
    return shapes_reward(images, prompts, metadata)


def _shapes_strict(images, prompts, metadata):
    """ShapeEval's pass/fail (1 iff every requirement holds); metadata as for ``shapes``."""
    from flowcredit.rewards.metadata import check_shapes_metadata
    from flowcredit.tasks.shapes import shapes_strict_reward

    check_shapes_metadata("shapes_strict", prompts, metadata)
    return shapes_strict_reward(images, prompts, metadata)


def _geneval(**options) -> RewardFn:
    """GenEval's rules over a detector (:func:`flowcredit.tasks.geneval.reward.geneval`: its options and
    scores). Its Mask2Former detector classifies colours with the CLIP that
    :func:`flowcredit.rewards.clip.load_clip` loads, handed to it here: rewards import tasks, never the
    other way round (tests/test_architecture.py)."""
    if "clip_loader" in options:
        raise UserError("reward 'geneval' has no option 'clip_loader'")
    from flowcredit.rewards.clip import load_clip
    from flowcredit.rewards.metadata import GenEvalChecked
    from flowcredit.tasks.geneval.reward import geneval

    return GenEvalChecked(geneval(**options, clip_loader=load_clip))


def _jpeg_kb(images) -> np.ndarray:
    from PIL import Image

    arr = (
        (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    )
    sizes = []
    for img in arr:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float32)


def jpeg_compressibility(images, prompts, metadata):
    """DDPO's compressibility: minus the JPEG size (kB, quality 95). Returns ``(B,)``."""
    return -torch.from_numpy(_jpeg_kb(images))


def jpeg_incompressibility(images, prompts, metadata):
    """Plus the JPEG size (kB, quality 95). Returns ``(B,)``."""
    return torch.from_numpy(_jpeg_kb(images))


def video_reward(fn: RewardFn) -> RewardFn:
    """Mark ``fn`` as a video reward: it takes whole clips ``(B, F, 3, H, W)`` (not one frame at a time)."""
    fn.takes_video = True
    return fn


def score_frames(fn: RewardFn, clips: torch.Tensor, prompts, metadata, frame_stride: int) -> torch.Tensor:
    """An image reward on clips ``(B, F, 3, H, W)``: the mean over frames ``0, k, 2k, …`` (``k =
    frame_stride``) of ``fn`` on each frame, every frame with its clip's prompt and metadata. ``(B,)``."""
    b = clips.shape[0]
    frames = clips[:, ::frame_stride]  # (B, F', 3, H, W)
    f = frames.shape[1]
    try:
        values = fn(
            frames.reshape(b * f, *frames.shape[2:]),
            [p for p in prompts for _ in range(f)],
            [m for m in metadata for _ in range(f)],
        )
    except RewardInputError as exc:  # a frame's input is its clip's
        raise exc.at(exc.index // f) from exc
    values = torch.as_tensor(values, dtype=torch.float32).reshape(-1).cpu()
    if values.shape[0] != b * f:
        raise RewardOutputError(
            f"reward returned {values.shape[0]} values for {b * f} frames ({b} clips × {f})"
        )
    return values.view(b, f).mean(dim=1)


def _import(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class _Lazy:
    """A factory named by ``"module:attr"``, imported on first use (keeps ``import flowcredit`` light)."""

    target: str

    def load(self) -> RewardFactory:
        return _import(self.target)

    def __call__(self, **options) -> RewardFn:
        return self.load()(**options)


def _plain(fn: RewardFn) -> RewardFactory:
    """A factory without options for a ready reward function."""

    def factory() -> RewardFn:
        return fn

    factory.__doc__ = fn.__doc__
    return factory


REWARDS: dict[str, RewardFactory] = {
    "shapes": _plain(_shapes),
    "shapes_strict": _plain(_shapes_strict),
    "jpeg_compressibility": _plain(jpeg_compressibility),
    "jpeg_incompressibility": _plain(jpeg_incompressibility),
    "ocr": _Lazy("flowcredit.rewards.ocr:ocr"),
    "pickscore": _Lazy("flowcredit.rewards.clip:pickscore"),
    "clipscore": _Lazy("flowcredit.rewards.clip:clipscore"),
    "aesthetic": _Lazy("flowcredit.rewards.clip:aesthetic"),
    "hps": _Lazy("flowcredit.rewards.hps:hps"),
    "imagereward": _Lazy("flowcredit.rewards.imagereward:imagereward"),
    "clip_product_head": _Lazy("flowcredit.rewards.clip:clip_product_head"),
    "remote": _Lazy("flowcredit.rewards.remote:remote"),
    "geneval": _geneval,
}


def _resolve_dotted(name: str) -> Callable:
    module, _, attr = name.partition(":")
    try:
        fn = _import(name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"reward {name!r}: cannot import {attr!r} from {module!r} ({exc})") from exc
    if not callable(fn):
        raise UserError(f"reward {name!r} is not callable")
    return fn


def _check_options(name: str, factory: Callable, options: dict) -> None:
    """Raise ``ValueError`` for an option ``factory`` does not take, or a required one not given."""
    target = factory.load() if isinstance(factory, _Lazy) else factory
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for option in options:
        if option not in accepted:
            raise UserError(f"reward {name!r} has no option {option!r}; its options: {accepted or 'none'}")
    for n in accepted:
        if params[n].default is inspect.Parameter.empty and n not in options:
            raise UserError(
                f'reward {name!r} needs option {n!r}: reward_options=\'{{"{name}": {{"{n}": ...}}}}\''
            )


def build_reward(name: str, options: dict | None = None) -> RewardFn:
    """One reward function from a registry name or ``"pkg.mod:fn"``, built with its ``options``.

    Building reads the weights the options name: what a factory raises while doing so (a missing file,
    a corrupt one, a bad option value, a missing optional package) is one :class:`UserError` naming
    the reward, even from a factory outside this package (:func:`_factory_error`)."""
    options = dict(options or {})
    offload = options.pop("offload", False)
    if offload not in (True, False):
        raise UserError(f"reward {name!r}: option 'offload' must be true or false, got {offload!r}")
    fn = _built(name, options)
    return offloaded(name, fn) if offload else fn


def offloaded(name: str, fn: RewardFn) -> RewardFn:
    """``fn`` with its networks (``fn.modules``) on the host between calls and on their device during
    one (the ``offload`` reward option: GPU memory only while scoring, two copies per call)."""
    import torch

    from flowcredit.models.memory_options import modules_on

    modules = getattr(fn, "modules", None)
    if not modules:
        raise UserError(f"reward {name!r}: option 'offload' needs a reward with networks of its own "
                        "(pickscore, clipscore, aesthetic, clip_product_head, hps, imagereward)")  # fmt: skip
    device = next(modules[0].parameters()).device
    for module in modules:
        module.to("cpu")

    def run(images, prompts, metadata):
        with modules_on(modules, device, "cpu"), torch.no_grad():
            return fn(images, prompts, metadata)

    run.modules = modules
    return run


def _built(name: str, options: dict) -> RewardFn:
    if name in REWARDS:
        factory = REWARDS[name]
    elif ":" in name:
        fn = _resolve_dotted(name)
        if not options:
            return fn
        factory = fn
    else:
        raise UserError(f"unknown reward {name!r}; registered: {sorted(REWARDS)} (or 'pkg.mod:fn')")
    _check_options(name, factory, options)
    try:
        return factory(**options)
    except UserError:
        raise
    except Exception as exc:
        error = _factory_error(name, exc)
        if error is None:
            raise
        raise error from exc


def _factory_error(name: str, exc: Exception) -> UserError | None:
    """``exc`` as one line naming the reward if a factory's input caused it (``OSError``, ``ValueError``,
    ``ImportError``, a corrupt safetensors file); None otherwise: a bug keeps its traceback."""
    from safetensors import SafetensorError

    if not isinstance(exc, (OSError, ValueError, ImportError, SafetensorError)):
        return None
    text = one_line(exc)
    prefix = f"{type(exc).__name__}: reward {name!r}"
    return UserError(text.split(": ", 1)[1] if text.startswith(prefix) else f"reward {name!r}: {text}")


def parse_mix(spec: str | dict[str, float]) -> dict[str, float]:
    """``"a=1,b=0.5"`` or ``{"a": 1}`` or ``"a"`` → ``{name: weight}``."""
    if isinstance(spec, dict):
        return {str(k): float(v) for k, v in spec.items()}
    mix = {}
    for part in spec.split(","):
        name, _, weight = part.strip().partition("=")
        try:
            mix[name] = float(weight) if weight else 1.0
        except ValueError:
            raise UserError(f"reward mix {spec!r}: weight of {name!r} is not a number") from None
    return mix


SHAPEEVAL_REWARDS = ("shapes", "shapes_strict")
"""Rewards that score from ShapeEval metadata (a run with one of them evaluates with the ShapeEval table)."""


def uses_shapeeval(spec: str | dict[str, float]) -> bool:
    """Whether the reward ``spec`` (a name or a mix) includes a ShapeEval reward."""
    return any(name in SHAPEEVAL_REWARDS for name in parse_mix(spec))


class Reward:
    """A weighted mix of rewards; ``__call__`` returns the total ``(B,)`` and keeps the components.

    Args:
        spec: a name, ``"pkg.mod:fn"``, ``"a=1,b=0.5"`` or ``{name: weight}``.
        options: ``{reward_name: {option: value}}``; each reward's factory is called once with its entry.
        frame_stride: on video clips ``(B, F, 3, H, W)``, an image reward scores every
            ``frame_stride``-th frame and averages them (a :func:`video_reward` takes the whole clip).
    """

    def __init__(self, spec: str | dict[str, float], options: dict | None = None, frame_stride: int = 1):
        if frame_stride < 1:
            raise UserError(f"reward frame_stride must be >= 1, got {frame_stride}")
        self.weights = parse_mix(spec)
        self.frame_stride = frame_stride
        options = dict(options or {})
        for name, opts in options.items():
            if name not in self.weights:
                raise UserError(f"reward_options names {name!r}, which is not in the reward spec {spec!r}")
            if not isinstance(opts, dict):
                raise UserError(f"reward_options[{name!r}] must be an object of options, got {opts!r}")
        self.fns = {name: build_reward(name, options.get(name)) for name in self.weights}
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, metadata) -> torch.Tensor:
        total, self.last_components = self.score(images, prompts, metadata)
        return total

    def score(self, images, prompts, metadata) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(total (B,), {name: component (B,)})`` without touching ``last_components`` (thread-safe)."""
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        components = {}
        for name, fn in self.fns.items():
            if images.ndim == 5 and not getattr(fn, "takes_video", False):
                value = score_frames(fn, images, prompts, metadata, self.frame_stride)
            else:
                value = torch.as_tensor(fn(images, prompts, metadata), dtype=torch.float32).reshape(-1).cpu()
            if value.shape[0] != images.shape[0]:
                raise RewardOutputError(
                    f"reward {name!r} returned {value.shape[0]} values for {images.shape[0]} images"
                )
            components[name] = value
            total = total + self.weights[name] * value
        return total, components


def check_metadata(reward: Reward, metas: list[dict], source: str) -> None:
    """Let every component of ``reward`` that checks prompt metadata (a ``check_metadata(metas, source)``
    method, e.g. ``geneval``) check the prompt set ``source`` before the first image is sampled."""
    for fn in getattr(reward, "fns", {}).values():
        if hasattr(fn, "check_metadata"):
            fn.check_metadata(metas, source)


def tabulator(reward) -> Callable | None:
    """The ``tabulate(images, prompts, metadata) -> {"soft", "strict", "category"}`` of a reward made of
    one component that has one (``geneval``: its per-tag table), else ``None``."""
    fns = list(getattr(reward, "fns", {}).values())
    return getattr(fns[0], "tabulate", None) if len(fns) == 1 else None


def get_reward(spec: str | dict[str, float], options: dict | None = None, frame_stride: int = 1) -> Reward:
    """Resolve a reward spec (name, 'pkg.mod:fn', or weighted mix); ``options`` are per-reward kwargs;
    ``frame_stride``: see :class:`Reward`."""
    return Reward(spec, options, frame_stride)
