"""The built-in tiny model: shapes, per-sample σ, CFG, tokenizer errors, checkpoint I/O."""

from __future__ import annotations

import json

import pytest
import torch

from flowcredit.models import FlowModel, TinyConfig, TinyFlowModel, Tokenizer, builtin_path, load_builtin
from flowcredit.tasks.shapes import VOCAB

torch.set_num_threads(2)
PROMPTS = ["two red circles", "a blue square above a green triangle", "a circle that is red"]


@pytest.fixture(scope="module")
def model() -> TinyFlowModel:
    """A random model whose zero-initialised output layer is perturbed so velocities are non-trivial."""
    m = TinyFlowModel(TinyConfig(vocab=tuple(VOCAB), guidance_scale=3.0), seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        m.net.unet.out.weight.copy_(0.05 * torch.randn(m.net.unet.out.weight.shape, generator=g))
    return m


def _inputs(b: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, 32, 32, generator=g), torch.rand(b, generator=g)


def test_protocol_and_shapes(model):
    assert isinstance(model, FlowModel)
    assert model.latent_shape == (3, 32, 32)
    x, sigma = _inputs()
    with torch.no_grad():
        cond = model.encode(PROMPTS)
        v = model.velocity(x, sigma, cond)
    assert cond.tokens.shape == (3, model.config.max_len, 64) and cond.pooled.shape == (3, 128)
    assert v.shape == (3, 3, 32, 32) and v.dtype == torch.float32 and torch.isfinite(v).all()
    img = model.decode(torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5))
    assert img[0, 0, 0].tolist() == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert torch.allclose(model.decode(model.to_latent(torch.full((1, 3, 2, 2), 0.3))), torch.tensor(0.3))
    n_params = sum(p.numel() for p in model.net.parameters())
    assert 0.8e6 < n_params < 1.5e6
    assert len(model.trainable_parameters()) == len(list(model.net.parameters()))


def test_per_sample_sigma(model):
    x, _ = _inputs()
    sigma = torch.tensor([0.1, 0.5, 0.9])
    with torch.no_grad():
        cond = model.encode(PROMPTS)
        batched = model.velocity(x, sigma, cond)
        rows = [model.velocity(x[i : i + 1], sigma[i : i + 1], cond[i]) for i in range(3)]
        same_sigma = model.velocity(x, torch.full((3,), 0.5), cond)
    torch.testing.assert_close(batched, torch.cat(rows), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(batched[0], same_sigma[0], atol=1e-4)
    torch.testing.assert_close(batched[1], same_sigma[1], atol=1e-4, rtol=1e-4)


def test_cfg(model):
    x, sigma = _inputs()
    with torch.no_grad():
        cond = model.encode(PROMPTS)
        model.guidance_scale = 1.0
        v_cond = model.velocity(x, sigma, cond)
        assert torch.equal(v_cond, model.predict(x, sigma, cond))
        v_null = model.velocity(x, sigma, cond.null.expand(3))
        model.guidance_scale = 3.0
        v = model.velocity(x, sigma, cond)
    torch.testing.assert_close(v, v_null + 3.0 * (v_cond - v_null), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(v_cond, v_null, atol=1e-4)


def test_text_encoder_trains_under_grad_mode(model):
    x, sigma = _inputs(2)
    model.net.zero_grad()
    model.velocity(x, sigma, model.encode(PROMPTS[:2])).pow(2).mean().backward()
    assert model.net.text.embed.weight.grad is not None and model.net.text.embed.weight.grad.abs().sum() > 0
    model.net.zero_grad()
    with torch.no_grad():
        assert not model.encode(PROMPTS[:1]).tokens.requires_grad


def test_bf16_autocast_returns_float32(model):
    x, sigma = _inputs(1)
    model.autocast = True
    try:
        with torch.no_grad():
            v = model.velocity(x, sigma, model.encode(PROMPTS[:1]))
    finally:
        model.autocast = False
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_tokenizer():
    tok = Tokenizer(VOCAB, max_len=12)
    ids, mask = tok(["two red circles", ""])
    assert ids.shape == mask.shape == (2, 12)
    assert mask[0].sum() == 3 and ids[1, 0] == 1 and mask[1].sum() == 1  # "" is the null caption
    assert tok(["Two  red, circles"])[0].equal(ids[:1])
    with pytest.raises(ValueError, match="'purple'") as err:
        tok(["two purple circles"])
    assert "two purple circles" in str(err.value) and "circles" in str(err.value)
    with pytest.raises(ValueError, match="maximum"):
        tok([" ".join(["red"] * 13)])


def test_save_load_roundtrip(model, tmp_path):
    model.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    loaded = TinyFlowModel.load(tmp_path / "ckpt")
    assert loaded.config == model.config and loaded.guidance_scale == model.guidance_scale
    x, sigma = _inputs()
    with torch.no_grad():
        assert torch.equal(
            model.velocity(x, sigma, model.encode(PROMPTS)), loaded.velocity(x, sigma, loaded.encode(PROMPTS))
        )
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        TinyConfig.from_dict(config)


def test_builtin_checkpoint():
    path = builtin_path()
    assert (path / "model.safetensors").stat().st_size < 10 * 2**20
    model = load_builtin()
    assert model.config.vocab == tuple(VOCAB)
    x, sigma = _inputs(2)
    with torch.no_grad():
        v = model.velocity(x, sigma, model.encode(PROMPTS[:2]))
    assert torch.isfinite(v).all() and v.abs().mean() > 0.1


def test_config_autocast_switches_the_run_not_the_checkpoint():
    from flowcredit.config import Config
    from flowcredit.errors import ConfigError
    from flowcredit.models import load_model

    model = load_model(Config(autocast=True))
    assert model.autocast and not model.config.autocast  # save_final writes model.config's setting
    assert not load_model(Config()).autocast
    with pytest.raises(ConfigError, match="autocast"):
        load_model(Config(model="test_video_shapes:load_toy_video", autocast=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upsample2x_is_nearest_interpolation_bit_for_bit(dtype):
    """The U-Net's broadcast-copy upsampling equals ``F.interpolate(…, "nearest")`` exactly, forward and
    backward (hand check: one pixel fills its 2×2 block; the block's four gradients sum back to it)."""
    import torch.nn.functional as F

    from flowcredit.models.tiny_net import upsample2x

    assert upsample2x(torch.tensor([[[[1.0, 2.0]]]])).tolist() == [
        [[[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0]]]
    ]
    g = torch.Generator().manual_seed(0)
    for h in (torch.randn(4, 6, 5, 7, generator=g), torch.randn(2, 3, 4, 4, generator=g).transpose(2, 3)):
        a, b = (h.to(dtype).clone().requires_grad_() for _ in range(2))
        ya, yb = F.interpolate(a, scale_factor=2.0, mode="nearest"), upsample2x(b)
        grad = torch.randn(ya.shape, generator=g).to(dtype)
        ya.backward(grad)
        yb.backward(grad)
        assert torch.equal(ya, yb) and torch.equal(a.grad, b.grad)
    x = torch.zeros(1, 1, 1, 2, requires_grad=True)
    upsample2x(x).backward(torch.arange(8.0).reshape(1, 1, 2, 4))
    assert x.grad.tolist() == [[[[0 + 1 + 4 + 5, 2 + 3 + 6 + 7]]]]
