"""Video latents ``(B, C, F, H, W)`` through the same loop: the sampler maths, the rollout, the state
values and every credit method are shape-agnostic (a clip gives exactly what the same numbers laid
out as a 4-D image latent give); image rewards score clips frame by frame; a toy video adapter trains
every preset; grids show clips as frame strips."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from flowcredit.advantages import CREDITS
from flowcredit.models import FlowModelBase
from flowcredit.presets import COMPARED_PRESETS, PRESETS
from flowcredit.rewards import Reward, get_reward, score_frames, video_reward
from flowcredit.run.evaluation import frame_strip, image_grid
from flowcredit.run.rollout import rollout, state_values
from flowcredit.sde import DEFAULT_LEVELS, SAMPLERS
from flowcredit.validation import validate

SHAPE = (4, 3, 4, 5)  # (C, F, H, W) of one clip latent


class ToyVideo(FlowModelBase):
    """A per-position flow model: channel mixing (one Linear) plus a prompt bias. Given ``(B, C, *S)``
    latents of any spatial rank, each position only sees its own channels, so the 5-D clip and the
    same numbers reshaped to 4-D give the same velocities."""

    def __init__(self, latent_shape=SHAPE):
        torch.manual_seed(0)
        self.latent_shape = latent_shape
        self.guidance_scale = 1.0
        self.net = nn.Sequential(nn.Linear(SHAPE[0], SHAPE[0]))
        self.default_lora_targets = "0"

    def encode(self, prompts):
        return torch.tensor([[len(p) % 5 / 5.0 + k / 10 for k in range(SHAPE[0])] for p in prompts])

    def velocity(self, x, sigma, cond):
        v = self.net(x.movedim(1, -1)).movedim(-1, 1)  # (B, C, *S)
        bias = (cond * (1.0 - sigma[:, None])).view(*cond.shape, *([1] * (x.ndim - 2)))
        return v + bias

    def decode(self, x):
        """Clips ``(B, F, 3, H, W)`` from 5-D latents, images ``(B, 3, H', W)`` from 4-D ones."""
        rgb = torch.sigmoid(x[:, :3])
        return rgb.movedim(1, 2) if x.ndim == 5 else rgb


def as_image(x: torch.Tensor) -> torch.Tensor:
    """``(B, C, F, H, W)`` → ``(B, C, F·H, W)``: the same numbers as a 4-D image latent."""
    return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


@pytest.mark.parametrize("name", SAMPLERS)
def test_every_sampler_step_is_shape_agnostic(name):
    g = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(3, *SHAPE, generator=g) for _ in range(3))
    sigma, sigma_next = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.7, 0.4, 0.1])
    level = min(DEFAULT_LEVELS[name], 0.5)
    clip = SAMPLERS[name](v, x, sigma, sigma_next, level, noise=noise)
    image = SAMPLERS[name](as_image(v), as_image(x), sigma, sigma_next, level, noise=as_image(noise))
    assert clip.x_next.shape == x.shape
    assert torch.equal(as_image(clip.x_next), image.x_next)
    assert torch.equal(as_image(clip.mean), image.mean) and torch.equal(clip.std, image.std)
    assert torch.allclose(clip.logp, image.logp, atol=1e-6, rtol=0)
    if name != "ode":
        assert (clip.std > 0).all() and not torch.equal(clip.logp, torch.zeros(3))
    again = SAMPLERS[name](v, x, sigma, sigma_next, level, x_next=clip.x_next)  # re-scoring
    assert torch.allclose(again.logp, clip.logp, atol=1e-6)


def brightness(images, rows):
    """A score of any decoded shape: the mean over every non-batch value."""
    return images.flatten(1).mean(dim=1)


@pytest.mark.parametrize("sampler", ["flow_sde", "cps", "ddim_sde"])
def test_rollout_values_and_every_advantage_match_the_flattened_run(sampler):
    """A clip rollout, its state values (every state completed) and every credit method's advantages
    equal those of the 4-D twin on the same numbers."""
    sigmas = torch.linspace(1.0, 0.0, 5)
    levels = torch.tensor([0.0, 0.6, 0.6, 0.0]) if sampler == "ddim_sde" else torch.full((4,), 0.6)
    trained = levels > 0
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    x0 = torch.randn(6, *SHAPE, generator=torch.Generator().manual_seed(2))
    out = {}
    for kind, model, start in (("clip", ToyVideo(), x0), ("image", ToyVideo((4, 12, 5)), as_image(x0))):
        cond = model.encode(["a red square", "two blue circles"])
        ro = rollout(
            model, cond, group, start, sigmas, levels, SAMPLERS[sampler], torch.Generator().manual_seed(3)
        )
        values, _ = state_values(
            model, cond, group, ro, sigmas, "states", trained, "ode_remaining", 1, brightness
        )
        out[kind] = ro, values
    (ro, values), (ro4, values4) = out["clip"], out["image"]
    assert ro.states.shape == (6, 5, *SHAPE)
    assert torch.equal(ro.states.reshape(ro4.states.shape), ro4.states)
    assert torch.allclose(ro.logp, ro4.logp, atol=1e-6) and torch.equal(ro.std, ro4.std)
    assert torch.allclose(values, values4, atol=1e-6, equal_nan=True) and not values[:, 1:].isnan().any()
    builtin = {n: c for n, c in CREDITS.items() if c.fn.__module__ == "flowcredit.advantages"}
    assert len(builtin) >= 4  # methods that other tests register (toy_credit_plugin) are not compared
    for name, credit in builtin.items():
        adv, adv4 = credit.fn(values, group, trained), credit.fn(values4, group, trained)
        assert adv.shape == (6, 4) and torch.allclose(adv, adv4, atol=1e-4), name


def per_image(images, prompts, metadata):
    """Image reward: mean red channel plus the prompt's length (so prompts reach every frame)."""
    assert images.ndim == 4
    return images[:, 0].flatten(1).mean(dim=1) + torch.tensor([len(p) for p in prompts], dtype=torch.float32)


def test_image_reward_on_clips_is_the_mean_over_frames():
    clips = torch.rand(2, 5, 3, 4, 4, generator=torch.Generator().manual_seed(4))
    prompts, metas = ["ab", "abcd"], [{}, {}]
    red = clips[:, :, 0].flatten(2).mean(dim=2)  # (B, F)
    by_hand = red.mean(dim=1) + torch.tensor([2.0, 4.0])
    reward = Reward({"test_video_shapes:per_image": 1.0})
    assert torch.allclose(reward(clips, prompts, metas), by_hand, atol=1e-6)
    strided = Reward({"test_video_shapes:per_image": 1.0}, frame_stride=2)  # frames 0, 2, 4
    assert torch.allclose(strided(clips, prompts, metas), red[:, ::2].mean(dim=1) + torch.tensor([2.0, 4.0]))
    assert not torch.allclose(strided(clips, prompts, metas), by_hand)
    assert torch.allclose(
        score_frames(per_image, clips, prompts, metas, 5), red[:, 0] + torch.tensor([2.0, 4.0])
    )
    jpeg = get_reward("jpeg_compressibility", frame_stride=1)(clips, prompts, metas)
    frames = get_reward("jpeg_compressibility")(clips.flatten(0, 1), [""] * 10, [{}] * 10).view(2, 5)
    assert torch.allclose(jpeg, frames.mean(dim=1))
    with pytest.raises(ValueError, match="frame_stride"):
        Reward("jpeg_compressibility", frame_stride=0)


@video_reward
def motion(clips, prompts, metadata):
    """A video reward: mean absolute change between consecutive frames (needs the whole clip)."""
    assert clips.ndim == 5
    return (clips[:, 1:] - clips[:, :-1]).abs().flatten(1).mean(dim=1)


def test_a_video_reward_takes_the_whole_clip():
    clips = torch.rand(3, 4, 3, 4, 4, generator=torch.Generator().manual_seed(5))
    mix = Reward("test_video_shapes:motion=1.0,test_video_shapes:per_image=0.5")
    total = mix(clips, ["a", "b", "c"], [{}] * 3)
    parts = mix.last_components
    assert torch.allclose(parts["test_video_shapes:motion"], motion(clips, [], []))
    assert torch.allclose(
        total, parts["test_video_shapes:motion"] + 0.5 * parts["test_video_shapes:per_image"]
    )


def test_frame_strip_and_grid_of_clips():
    clips = torch.rand(2, 11, 3, 4, 6)
    strip = frame_strip(clips)  # 8 frames of 11, evenly spread, first and last included
    assert strip.shape == (2, 3, 4, 8 * 6)
    assert torch.equal(strip[..., :6], clips[:, 0]) and torch.equal(strip[..., -6:], clips[:, -1])
    assert torch.equal(frame_strip(clips[:, :3]), torch.cat([clips[:, 0], clips[:, 1], clips[:, 2]], dim=-1))
    images = torch.rand(2, 3, 4, 4)
    assert frame_strip(images) is images
    grid = image_grid(clips, ["one prompt"], ncols=2, scale=2)
    assert grid.size == (2 * (48 * 2 + 4) + 4, 4 * 2 + 4 + 14 + 4)


def load_toy_video(cfg):
    return ToyVideo()


@pytest.mark.parametrize("preset", COMPARED_PRESETS)
def test_a_video_adapter_trains_every_preset(preset, tmp_path):
    from flowcredit.train import train

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\ntwo blue circles\na cat\n")
    cfg = dataclasses.replace(
        PRESETS[preset](),
        model="test_video_shapes:load_toy_video",
        reward="jpeg_compressibility",
        reward_frame_stride=2,
        train_prompts=str(prompts),
        eval_prompts=str(prompts),
        num_steps=4,
        group_size=2,
        prompts_per_iter=2,
        batch_size=4,
        iterations=1,
        eval_every=0,
        num_eval_prompts=2,
        eval_samples_per_prompt=1,
        window_size=0,
        calibrate=False,
        window_start=1 if preset == "stepwise_grpo" else 0,
        run_dir=str(tmp_path / "run"),
        threads=1,
    )
    train(validate(cfg))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["iteration"] == 1 and "loss/policy" in rows[-1]
    assert (tmp_path / "run" / "grid_start_test.png").is_file()


def load_toy_image(cfg):
    return ToyVideo(latent_shape=(4, 4, 5))  # (C, H, W): an adapter that makes images


def test_num_frames_needs_an_adapter_that_makes_video():
    """An import path's adapter is known once loaded: ``num_frames`` on one with an image latent is a
    config error, not silently ignored; on a video adapter it loads."""
    from flowcredit.config import Config
    from flowcredit.errors import ConfigError
    from flowcredit.models import load_model

    video = Config(model="test_video_shapes:load_toy_video", num_frames=5)
    assert tuple(load_model(validate(video)).latent_shape) == SHAPE
    image = validate(Config(model="test_video_shapes:load_toy_image", num_frames=5))
    with pytest.raises(
        ConfigError, match="'num_frames': 5 frames, but 'test_video_shapes:load_toy_image' makes"
    ):
        load_model(image)
