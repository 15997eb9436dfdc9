"""Rewards for trainer tests, importable as ``reward_fixtures:NAME`` (tests/ is on sys.path)."""

import torch


def nan_for_red(images, prompts, metadata):
    """Brightness, but NaN for prompts mentioning 'red' (a broken reward)."""
    out = images.mean(dim=(1, 2, 3))
    bad = torch.tensor(["red" in p for p in prompts])
    return torch.where(bad, torch.full_like(out, float("nan")), out)


def raises(images, prompts, metadata):
    raise RuntimeError("reward server unreachable")


def brightness(images, prompts, metadata):
    """The mean pixel value of each image (a hand-made reward with a known direction)."""
    return images.mean(dim=(1, 2, 3))


def prompt_channel(images, prompts, metadata):
    """The mean of colour channel ``len(prompt) % 3``: a reward that also depends on the prompt, so a
    value scored with another row's prompt differs."""
    channel = torch.tensor([len(p) % 3 for p in prompts])
    return images.mean(dim=(2, 3))[torch.arange(len(prompts)), channel]
