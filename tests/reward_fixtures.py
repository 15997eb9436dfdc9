"""Rewards for trainer tests, importable as ``reward_fixtures:NAME`` (tests/ is on sys.path)."""

import torch


def nan_for_red(images, prompts, metadata):
    """Brightness, but NaN for prompts mentioning 'red' (a broken reward)."""
    out = images.mean(dim=(1, 2, 3))
    bad = torch.tensor(["red" in p for p in prompts])
    return torch.where(bad, torch.full_like(out, float("nan")), out)


def raises(images, prompts, metadata):
    raise RuntimeError("reward server unreachable")
