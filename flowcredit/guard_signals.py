"""The reward-hacking guard's signals and alarm rules: small pure functions (docs/guard.md).

Every signal is measured at each evaluation on the held-out prompts' samples, drawn with the ODE
sampler from fixed noise, so two evaluations differ only by the model:

- **monitors**: rewards that are scored but never trained on; the alarm fires when one falls more
  than ``guard_noise_mult`` noise floors below its best (:func:`monitor_declined`), or, with the rule
  ``hack``, only while the trained reward stands higher than it did at that best (:func:`monitor_fell`);
- **diversity**: the spread of a prompt's samples (:func:`sample_spread`);
- **artefacts**: mean HSV saturation (:func:`saturation`), the colour histogram's total-variation
  drift from the start (:func:`colour_histogram`, :func:`histogram_tv`) and the share of spectral energy
  above half the Nyquist frequency (:func:`high_frequency_share`: grids, ringing, noise);
- **drift**: the trained weights' relative distance from the start (:func:`weight_drift`).

No signal comes from a paper: these are the failure modes the peers' users reported (grid artefacts,
over-saturation, collapsed variety, out-of-domain scores falling while the trained one climbs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GUARD_ACTIONS = ("off", "warn", "stop", "rollback")
"""What the guard does when a signal fires: nothing (no signal is measured), log and mark the
curves, end the run, or restore ``best/`` and go on (docs/guard.md)."""

FEATURE_SIZE = 32
"""Images are average-pooled to at most this size before :func:`sample_spread` (pixels as features)."""

HIGH_FREQUENCY = 0.25
"""Cycles per pixel above which :func:`high_frequency_share` counts energy (half the Nyquist 0.5)."""


def as_frames(images: torch.Tensor) -> torch.Tensor:
    """Images ``(B, 3, H, W)`` or clips ``(B, F, 3, H, W)`` as frames ``(n, 3, H, W)``, float32."""
    return images.reshape(-1, *images.shape[-3:]).float()


def sample_spread(images: torch.Tensor, samples_per_prompt: int) -> float:
    """Diversity: the mean over prompts of the RMS pixel distance between two samples of one prompt,

    ``D = mean_p mean_{j≠l} ‖f(x_pj) − f(x_pl)‖₂ / √d``, ``f``: the image average-pooled to at most
    :data:`FEATURE_SIZE` pixels a side (a clip: all its frames), ``d`` its size. In [0, 1] for images in
    [0, 1]; 0 when every prompt's samples are equal (collapse).

    Args:
        images: ``(P·k, 3, H, W)`` or ``(P·k, F, 3, H, W)``, prompt-major (``k`` samples per prompt).
    """
    k = samples_per_prompt
    if k < 2 or len(images) % k:
        raise ValueError(f"sample_spread needs k ≥ 2 samples per prompt dividing {len(images)}, got k = {k}")
    frames = as_frames(images)  # (n, 3, H, W)
    size = min(FEATURE_SIZE, frames.shape[-1])
    features = F.adaptive_avg_pool2d(frames, size).reshape(len(images) // k, k, -1).double()  # (P, k, d)
    dist = torch.cdist(features, features, compute_mode="donot_use_mm_for_euclid_dist")  # (P, k, k)
    pairs = dist.sum(dim=(1, 2)) / (k * (k - 1))  # (P,) the diagonal is 0
    return (pairs.mean() / math.sqrt(features.shape[-1])).item()


def saturation(images: torch.Tensor, eps: float = 1e-6) -> float:
    """Mean HSV saturation ``S = (max_c − min_c) / max_c`` over all pixels (0 where ``max_c < eps``)."""
    frames = as_frames(images).double()
    high, low = frames.amax(dim=1), frames.amin(dim=1)  # (n, H, W)
    sat = torch.where(high > eps, (high - low) / high.clamp_min(eps), torch.zeros_like(high))
    return sat.mean().item()


def colour_histogram(images: torch.Tensor, bins: int = 4) -> torch.Tensor:
    """The joint RGB histogram of all pixels, ``bins`` levels per channel: ``(bins³,)`` summing to 1.
    A channel value ``v ∈ [0, 1]`` falls in level ``min(⌊v·bins⌋, bins − 1)``."""
    frames = as_frames(images)
    level = (frames.clamp(0, 1) * bins).floor().long().clamp_max(bins - 1)  # (n, 3, H, W)
    joint = (level[:, 0] * bins + level[:, 1]) * bins + level[:, 2]  # (n, H, W)
    counts = torch.bincount(joint.flatten(), minlength=bins**3).double()
    return counts / counts.sum()


def histogram_tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total-variation distance ``½ Σ |p − q|`` of two histograms (0: equal, 1: disjoint)."""
    p, q = (torch.as_tensor(h, dtype=torch.float64) for h in (p, q))
    return (0.5 * (p - q).abs().sum()).item()


def high_frequency_share(images: torch.Tensor, cutoff: float = HIGH_FREQUENCY) -> float:
    """The share of the luminance's spectral energy above ``cutoff`` cycles per pixel,

    ``Σ_{|f| > cutoff} |Ŷ(f)|² / Σ_{f ≠ 0} |Ŷ(f)|²`` over all frames, ``Y`` the channel mean with each
    frame's mean removed (``Ŷ``: its 2-D DFT, ``|f| = √(f_y² + f_x²)``). A flat image gives 0.
    """
    gray = as_frames(images).double().mean(dim=1)  # (n, H, W)
    gray = gray - gray.mean(dim=(1, 2), keepdim=True)
    power = torch.fft.fft2(gray).abs() ** 2  # (n, H, W)
    fy = torch.fft.fftfreq(gray.shape[1], dtype=torch.float64)[:, None]
    fx = torch.fft.fftfreq(gray.shape[2], dtype=torch.float64)[None, :]
    high = (fy**2 + fx**2).sqrt() > cutoff  # (H, W)
    total = power.sum().item()
    return power[:, high].sum().item() / total if total > 0 else 0.0


def weight_drift(params: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """Relative distance of the trained weights from the start, ``‖θ − θ₀‖₂ / ‖θ₀‖₂`` over all tensors
    (a LoRA: its A and B; B starts at 0, so this is ``‖ΔA, B‖ / ‖A₀‖``)."""
    num = sum(((p.detach().double() - s.double()) ** 2).sum() for p, s in zip(params, start, strict=True))
    den = sum((s.double() ** 2).sum() for s in start)
    return math.sqrt(float(num) / float(den)) if float(den) > 0 else math.sqrt(float(num))


def monitor_fell(monitor: float, trained: float, best: float, trained_at_best: float, floor: float, mult):
    """The monitor alarm: ``monitor < best − mult·floor`` while ``trained > trained_at_best``.

    ``best``: the monitor's highest value at an earlier evaluation without alarm, ``trained_at_best``
    the trained reward then; ``floor``: the monitor's noise floor (std over 3 noise seeds at the start).
    A monitor that falls while the trained reward falls too is a run getting worse, not a hack.
    """
    return monitor < best - mult * floor and trained > trained_at_best


def monitor_declined(monitor: float, trained: float, best: float, trained_at_best: float, floor: float, mult):
    """The monitor alarm whatever the trained reward did: ``monitor < best − mult·floor``. A run that
    degrades as a whole (its trained reward falling too) is caught as well as a hack."""
    return monitor < best - mult * floor


MONITOR_RULES = {"fall": monitor_declined, "hack": monitor_fell}
"""The monitor alarm by ``guard_monitor_rule``: any fall past the floors, or only while the trained
reward stands higher than it did at the monitor's best (docs/guard.md)."""


def thresholds_crossed(values: dict, start: dict, limits: dict) -> dict[str, str]:
    """The signals past their limits, each with a one-line reason; a limit of 0 is off.

    ``values``/``start``: this and the start evaluation's ``diversity``, ``saturation``, ``high_freq``
    (and ``values``: ``histogram_tv``, ``drift``); ``limits``: the config's ``diversity_frac`` (alarm
    below that fraction of the start), ``saturation_delta`` (a move further than this),
    ``histogram_tv`` (past this), ``high_freq_ratio`` (past this multiple of the start) and
    ``drift_max`` (past this).
    """
    now, was = values, start
    fired = {}
    if limits["diversity_frac"] and now["diversity"] < limits["diversity_frac"] * was["diversity"]:
        fired["diversity"] = f"diversity {now['diversity']:.4f}, start {was['diversity']:.4f}"
    if limits["saturation_delta"] and abs(now["saturation"] - was["saturation"]) > limits["saturation_delta"]:
        fired["saturation"] = f"saturation {now['saturation']:.3f}, start {was['saturation']:.3f}"
    if limits["histogram_tv"] and now["histogram_tv"] > limits["histogram_tv"]:
        fired["histogram_tv"] = f"colour histogram {now['histogram_tv']:.3f} (TV) from the start's"
    if limits["high_freq_ratio"] and now["high_freq"] > limits["high_freq_ratio"] * was["high_freq"]:
        fired["high_freq"] = f"high-frequency energy {now['high_freq']:.4f}, start {was['high_freq']:.4f}"
    if limits["drift_max"] and now.get("drift", 0.0) > limits["drift_max"]:
        fired["drift"] = f"weights moved {now['drift']:.4f} (relative) from the start"
    return fired
