"""The reward-hacking guard's signals and alarm rules (flowcredit/guard_signals.py) on hand-made images and
curves: each against a hand computation or a closed form; each fires on the failure it is for and
stays quiet on noise at the floor."""

from __future__ import annotations

import math
import random

import pytest
import torch

from flowcredit.guard_signals import (
    MONITOR_RULES,
    colour_histogram,
    high_frequency_share,
    histogram_tv,
    monitor_declined,
    monitor_fell,
    sample_spread,
    saturation,
    thresholds_crossed,
    weight_drift,
)

LIMITS = {  # the config's defaults (guard_*)
    "diversity_frac": 0.5,
    "saturation_delta": 0.15,
    "histogram_tv": 0.25,
    "high_freq_ratio": 2.0,
    "drift_max": 0.0,
}


def smooth_images(n: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    """``(n, 3, size, size)`` smooth random colour fields in about [0.2, 0.8] (low-pass noise)."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand((n, 3, 4, 4), generator=gen)
    return 0.2 + 0.6 * torch.nn.functional.interpolate(coarse, size=size, mode="bicubic").clamp(0, 1)


def signals(images: torch.Tensor, k: int, start_hist: torch.Tensor | None = None) -> dict:
    hist = colour_histogram(images)
    return {
        "diversity": sample_spread(images, k),
        "saturation": saturation(images),
        "high_freq": high_frequency_share(images),
        "histogram_tv": histogram_tv(hist, hist if start_hist is None else start_hist),
    }


# --- each signal against a hand computation ----------------------------------------------------------


def test_sample_spread_by_hand():
    # prompt 0: a black and a white 4x4 image (distance √48 over √48 features = 1); prompt 1: equal (0)
    images = torch.stack(
        [torch.zeros(3, 4, 4), torch.ones(3, 4, 4), torch.full((3, 4, 4), 0.3), torch.full((3, 4, 4), 0.3)]
    )
    assert sample_spread(images, 2) == pytest.approx(0.5, abs=1e-12)
    # three samples of one prompt at 0, 0.1, 0.4: pair distances 0.1, 0.4, 0.3 (per feature), mean 0.8/3
    three = torch.stack([torch.full((3, 4, 4), v) for v in (0.0, 0.1, 0.4)])
    assert sample_spread(three, 3) == pytest.approx(0.8 / 3, abs=1e-7)


def test_sample_spread_pools_large_images_to_32():
    # a 64x64 image whose 2x2 blocks are constant pools exactly to its 32x32 version
    small = smooth_images(4, 32)
    large = small.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    assert sample_spread(large, 2) == pytest.approx(sample_spread(small, 2), rel=1e-6)
    with pytest.raises(ValueError, match="k ≥ 2"):
        sample_spread(small, 1)


def test_saturation_by_hand():
    img = torch.zeros(1, 3, 1, 4)
    img[0, :, 0, 0] = torch.tensor([1.0, 0.5, 0.0])  # S = 1
    img[0, :, 0, 1] = torch.tensor([0.5, 0.5, 0.5])  # S = 0 (grey)
    img[0, :, 0, 2] = torch.tensor([0.8, 0.4, 0.2])  # S = 0.6 / 0.8 = 0.75
    # pixel 3 black: S = 0
    assert saturation(img) == pytest.approx((1 + 0 + 0.75 + 0) / 4)


def test_colour_histogram_and_tv_by_hand():
    img = torch.zeros(1, 3, 1, 4)
    img[0, :, 0, 0] = torch.tensor([0.9, 0.1, 0.1])  # levels (1, 0, 0) → bin 4
    img[0, :, 0, 1] = torch.tensor([0.9, 0.1, 0.1])
    img[0, :, 0, 2] = torch.tensor([1.0, 1.0, 1.0])  # v = 1 falls in the top level: bin 7
    img[0, :, 0, 3] = torch.tensor([0.2, 0.6, 0.3])  # (0, 1, 0) → bin 2
    hist = colour_histogram(img, bins=2)
    assert hist.tolist() == [0, 0, 0.25, 0, 0.5, 0, 0, 0.25]
    assert histogram_tv(hist, torch.tensor([0, 0, 0.25, 0, 0.25, 0.25, 0, 0.25])) == pytest.approx(0.25)
    assert histogram_tv(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 1.0


def test_high_frequency_share_closed_form():
    # cos(2π x / 16) (f = 1/16, below the cutoff 0.25) plus a checkerboard (f = (½, ½), above it):
    # by Parseval the energies are A²/2 and B² per pixel, so the share is B² / (A²/2 + B²)
    y, x = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    a, b = 1.0, 0.5
    slow, checker = a * torch.cos(2 * math.pi * x / 16), b * (-1) ** (x + y)
    gray = (slow + checker).expand(1, 3, 16, 16)
    assert high_frequency_share(gray) == pytest.approx(b**2 / (a**2 / 2 + b**2), abs=1e-7)  # float32 input
    assert high_frequency_share(slow.expand(1, 3, 16, 16)) == pytest.approx(0.0, abs=1e-12)
    assert high_frequency_share(torch.full((2, 3, 8, 8), 0.4)) == 0.0  # flat: no energy at all


def test_high_frequency_share_of_a_clip_is_that_of_its_frames():
    frames = smooth_images(6, 16)
    clips = frames.reshape(2, 3, 3, 16, 16)  # (B, F, 3, H, W)
    assert high_frequency_share(clips) == pytest.approx(high_frequency_share(frames), rel=1e-12)


def test_weight_drift_by_hand():
    start = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]])]  # ‖θ₀‖ = 5
    now = [torch.tensor([3.0, 1.0]), torch.tensor([[0.0, 4.0]])]
    assert weight_drift(now, start) == pytest.approx(1 / 5)
    assert weight_drift([torch.ones(2)], [torch.zeros(2)]) == pytest.approx(math.sqrt(2))  # θ₀ = 0: absolute


# --- the alarm rules: fire on the failure, quiet at the floor -----------------------------------------


def test_monitor_alarm_needs_a_fall_past_the_floor_and_a_rising_trained_reward():
    best, floor = 0.30, 0.01
    assert monitor_fell(0.27, 0.70, best, 0.60, floor, 2.0)  # fell 3 floors while the trained reward rose
    assert not monitor_fell(0.285, 0.70, best, 0.60, floor, 2.0)  # 1.5 floors: noise
    assert not monitor_fell(0.27, 0.55, best, 0.60, floor, 2.0)  # both fell: getting worse, not a hack


def false_alarms(rule, mult: float, patience: int, evaluations: int = 50, runs: int = 400) -> float:
    """The share of evaluations at which the monitor ``rule`` acts on a policy that never changes, when
    every evaluation's monitor and trained reward move by independent noise at the floor (pessimistic:
    with fixed evaluation noise, nearby policies' readings are correlated). The best is the highest
    reading without alarm so far, as in the guard; it acts after ``patience`` alarming evaluations in a
    row."""
    draw, floor, acted = random.Random(0), 0.01, 0
    for _ in range(runs):
        best, trained_then, streak = 0.30 + floor * draw.gauss(0, 1), 0.60 + floor * draw.gauss(0, 1), 0
        for _ in range(evaluations - 1):
            monitor, trained = 0.30 + floor * draw.gauss(0, 1), 0.60 + floor * draw.gauss(0, 1)
            fell = rule(monitor, trained, best, trained_then, floor, mult)
            streak = streak + 1 if fell else 0
            acted += streak >= patience
            if not fell and monitor > best:
                best, trained_then = monitor, trained
    return acted / (runs * (evaluations - 1))


def test_monitor_alarm_is_rare_on_noise_at_its_floor():
    # the defaults (rule 'fall', guard_noise_mult 4, guard_patience 2): 0.2 % of evaluations
    assert false_alarms(monitor_declined, 4.0, 2) < 0.005
    # why both: 3 floors at once act on 16 % of them, 3 floors twice in a row on 4 % (docs/guard.md)
    assert false_alarms(monitor_declined, 3.0, 1) > 0.1 and false_alarms(monitor_declined, 3.0, 2) > 0.02
    # the 'hack' rule also needs the trained reward higher than at the best: about half as often
    assert false_alarms(monitor_fell, 3.0, 2) < 0.02


def test_monitor_rules_on_a_hack_and_on_a_collapse():
    # the same noise after a hack: the monitor 6 floors lower, the trained reward higher; both rules fire
    draw, floor = random.Random(1), 0.01
    hack = [(0.30 + floor * (draw.gauss(0, 1) - 6), 0.65 + floor * draw.gauss(0, 1)) for _ in range(100)]
    for rule in MONITOR_RULES.values():
        assert sum(rule(m, t, 0.30, 0.60, floor, 4.0) for m, t in hack) >= 95
    # a collapse: both fall; only 'fall' fires
    collapse = [(m, t - 0.2) for m, t in hack]
    assert sum(MONITOR_RULES["fall"](m, t, 0.30, 0.60, floor, 4.0) for m, t in collapse) >= 95
    assert not any(MONITOR_RULES["hack"](m, t, 0.30, 0.60, floor, 4.0) for m, t in collapse)


def test_image_signals_quiet_on_pixel_noise():
    images = smooth_images(16)
    start = signals(images, 4)
    gen = torch.Generator().manual_seed(1)
    noisy = (images + 0.01 * torch.randn(images.shape, generator=gen)).clamp(0, 1)
    now = signals(noisy, 4, colour_histogram(images))
    assert thresholds_crossed(now, start, LIMITS) == {}


def test_diversity_fires_on_collapse():
    images = smooth_images(16)
    start = signals(images, 4)
    collapsed = images.reshape(4, 4, 3, 32, 32)[:, :1].expand(4, 4, 3, 32, 32).reshape(16, 3, 32, 32)
    now = signals(collapsed, 4, colour_histogram(images))
    assert now["diversity"] == 0.0
    assert "diversity" in thresholds_crossed(now, start, LIMITS)


def test_high_frequency_fires_on_a_grid_artefact():
    images = smooth_images(16)
    start = signals(images, 4)
    y, x = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    grid = ((x % 4 == 0) | (y % 4 == 0)).float()  # a 4-pixel lattice, as in flow_grpo #233
    now = signals((images + 0.3 * grid).clamp(0, 1), 4, colour_histogram(images))
    assert now["high_freq"] > 2 * start["high_freq"]
    assert "high_freq" in thresholds_crossed(now, start, LIMITS)


def test_saturation_and_colour_fire_on_over_saturation():
    images = smooth_images(16)
    start = signals(images, 4)
    mean = images.mean(dim=1, keepdim=True)
    vivid = (mean + 3.0 * (images - mean)).clamp(0, 1)  # colours pushed away from grey
    fired = thresholds_crossed(signals(vivid, 4, colour_histogram(images)), start, LIMITS)
    assert {"saturation", "histogram_tv"} <= set(fired)


def test_a_limit_of_zero_is_off_and_drift_fires_past_its_budget():
    images = smooth_images(16)
    start = signals(images, 4)
    off = dict.fromkeys(LIMITS, 0.0)
    collapsed = images[:1].expand(16, 3, 32, 32)
    assert thresholds_crossed(signals(collapsed, 4, colour_histogram(images)), start, off) == {}
    assert set(thresholds_crossed({**start, "drift": 0.3}, start, {**off, "drift_max": 0.2})) == {"drift"}
    assert thresholds_crossed({**start, "drift": 0.1}, start, {**off, "drift_max": 0.2}) == {}
