"""The real-size modules of ``flowcredit memory`` on fake tensors (no weights, no GPU): SD3.5-Medium /
-Large and FLUX.1-dev pipelines (transformer, VAE, CLIP-L, CLIP-G, T5-XXL) from their hub configs, and
the reward networks whose weights share the GPU with them (PickScore / HPS v2.1: CLIP ViT-H/14;
CLIP score and the aesthetic head: CLIP ViT-L/14; GenEval: Mask2Former Swin-S and CLIP ViT-L/14)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch import nn

from flowcredit.config import Config
from flowcredit.errors import ConfigError

PROMPT = "a photo of a red cat next to a big blue square on the sign"

SD35_MEDIUM = {  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    **dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, pos_embed_max_size=384),
    **dict(num_layers=24, attention_head_dim=64, num_attention_heads=24, qk_norm="rms_norm"),
    **dict(joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048),
    "dual_attention_layers": tuple(range(13)),
}
SD35_LARGE = {  # stabilityai/stable-diffusion-3.5-large transformer/config.json
    **dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, pos_embed_max_size=192),
    **dict(num_layers=38, attention_head_dim=64, num_attention_heads=38, qk_norm="rms_norm"),
    **dict(joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048),
}
SD3_VAE = {  # its vae/config.json
    **dict(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2),
    **dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4),
    **dict(sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, norm_num_groups=32),
    **dict(use_quant_conv=False, use_post_quant_conv=False),
}
FLUX_DEV = dict(guidance_embeds=True)  # black-forest-labs/FLUX.1-dev: diffusers' defaults otherwise (11.9 B)
FLUX_VAE = SD3_VAE | dict(scaling_factor=0.3611, shift_factor=0.1159)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12)
CLIP_L |= dict(
    num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu"
)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32)
CLIP_G |= dict(num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
T5_XXL |= dict(feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
TINY_TEXT = dict(num_hidden_layers=1, intermediate_size=64, num_attention_heads=1)
"""``text_encoders="tiny"``: 1-layer encoders with the real output widths (the 2026-11-29 GPU check's)."""
SIZES = {"sd3": {"medium": SD35_MEDIUM, "large": SD35_LARGE}, "flux": {"dev": FLUX_DEV}}


@contextlib.contextmanager
def fake_building(dtype: torch.dtype):
    """Build modules on fake CPU tensors in ``dtype``; ``Module.to`` is a no-op meanwhile (fake
    parameters cannot be swapped, and the device and dtype are set at construction)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    @contextlib.contextmanager
    def building(dtype):
        saved_to, saved_dtype = nn.Module.to, torch.get_default_dtype()
        nn.Module.to = lambda self, *args, **kwargs: self
        torch.set_default_dtype(dtype)
        try:
            with mode:
                yield
        finally:
            nn.Module.to = saved_to
            torch.set_default_dtype(saved_dtype)

    with building(dtype):
        yield SimpleNamespace(mode=mode, building=building)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def word_tokenizer(max_length: int):
    """A word-level tokenizer that pads to ``max_length`` (token ids, not the real vocabulary: the
    memory depends on the sequence length only)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", *PROMPT.split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        eos_token="[EOS]",
        model_max_length=max_length,
    )


def text_encoders(model: str, tiny: bool, dtype: torch.dtype) -> dict:
    """The pipeline's text encoders and tokenizers at real size (or 1-layer, ``tiny``), in ``dtype``."""
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    shrink = TINY_TEXT if tiny else {}
    t5 = T5_XXL | (dict(num_layers=1, d_ff=64, num_heads=1, vocab_size=64) if tiny else {})
    with default_dtype(dtype):
        clip_l = CLIPTextConfig(**(CLIP_L | shrink), eos_token_id=2, pad_token_id=0)
        t5_model = T5EncoderModel(T5Config(**t5, pad_token_id=0, eos_token_id=2))
        if model == "flux":
            return dict(
                text_encoder=CLIPTextModel(clip_l),
                tokenizer=word_tokenizer(77),
                text_encoder_2=t5_model,
                tokenizer_2=word_tokenizer(512),
            )
        clip_g = CLIPTextConfig(**(CLIP_G | shrink), eos_token_id=2, pad_token_id=0)
        return dict(
            text_encoder=CLIPTextModelWithProjection(clip_l),
            tokenizer=word_tokenizer(77),
            text_encoder_2=CLIPTextModelWithProjection(clip_g),
            tokenizer_2=word_tokenizer(77),
            text_encoder_3=t5_model,
            tokenizer_3=word_tokenizer(512),
        )


def scheduler_of(model: str):
    """The checkpoint's scheduler (built outside the fake mode: its constructor reads numbers back)."""
    import diffusers

    if model == "sd3":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
    )


def build_fake_model(cfg: Config, size: str, scheduler, tiny_text: bool = False):
    """The SD3 / FLUX.1 adapter over a real-size pipeline of fake tensors (call inside
    :func:`fake_building`): transformer and text encoders in ``cfg.dtype``, VAE in float32."""
    import diffusers

    from flowcredit.models.diffusers_common import pretrained_options, resolve_dtype

    dtype = resolve_dtype(cfg.dtype if cfg.dtype != "auto" else "bfloat16")
    if cfg.model not in SIZES:
        raise ConfigError("model", f"{cfg.model!r}: `flowcredit memory` knows {sorted(SIZES)}")
    if size not in SIZES[cfg.model]:
        raise ConfigError("size", f"{size!r} for {cfg.model}: one of {sorted(SIZES[cfg.model])}")
    with default_dtype(dtype):
        if cfg.model == "sd3":
            net = diffusers.SD3Transformer2DModel(**SIZES["sd3"][size])
        else:
            net = diffusers.FluxTransformer2DModel(**SIZES["flux"][size])
    with default_dtype(torch.float32):
        vae = diffusers.AutoencoderKL(**(SD3_VAE if cfg.model == "sd3" else FLUX_VAE))
    texts = text_encoders(cfg.model, tiny_text, dtype)
    opts = pretrained_options(cfg)
    if cfg.model == "sd3":
        from flowcredit.models.sd3 import SD3FlowModel

        pipe = diffusers.StableDiffusion3Pipeline(transformer=net, scheduler=scheduler, vae=vae, **texts)
        model = SD3FlowModel(pipe, opts["resolution"], opts["guidance_scale"], opts["max_sequence_length"])
    else:
        from flowcredit.models.flux import FluxFlowModel

        pipe = diffusers.FluxPipeline(transformer=net, scheduler=scheduler, vae=vae, **texts)
        model = FluxFlowModel(pipe, opts["resolution"], opts["guidance_scale"], opts["max_sequence_length"])
    pipe.set_progress_bar_config(disable=True)
    return model


CLIP_H14 = dict(  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K (PickScore's base; HPS v2.1's open_clip ViT-H-14)
    text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
    vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16),
    projection_dim=1024,
    act="gelu",
)
CLIP_L14 = dict(  # openai/clip-vit-large-patch14 (CLIP score, the aesthetic head, GenEval's colours)
    text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
    projection_dim=768,
    act="quick_gelu",
)
REWARD_CLIPS = {"pickscore": CLIP_H14, "hps": CLIP_H14, "clipscore": CLIP_L14, "aesthetic": CLIP_L14}
REWARD_CLIPS["geneval"] = CLIP_L14
REWARD_DTYPE = {"pickscore": "float32", "hps": "float32", "clipscore": "float32", "aesthetic": "float32"}
REWARD_DTYPE["geneval"] = "float32"
"""The rewards' default ``dtype`` option (docs/rewards.md)."""


def clip_model(spec: dict, dtype: torch.dtype):
    """A CLIP model of ``spec`` (call inside :func:`fake_building`): 224 px, patch 14, 77 tokens."""
    from transformers import CLIPConfig, CLIPModel

    act = dict(hidden_act=spec["act"])
    text = spec["text"] | act | dict(max_position_embeddings=77, vocab_size=49408)
    vision = spec["vision"] | act | dict(image_size=224, patch_size=14)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=spec["projection_dim"])
    with default_dtype(dtype):
        return CLIPModel(config)


def geneval_detector(dtype: torch.dtype):
    """GenEval's detector, Mask2Former Swin-S on COCO's 80 classes (weights only: its forward reads
    numbers back, which fake tensors cannot)."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    swin = SwinConfig(embed_dim=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24], window_size=7)
    swin.out_features = ["stage1", "stage2", "stage3", "stage4"]
    config = Mask2FormerConfig(backbone_config=swin, num_labels=80, use_pretrained_backbone=False)
    with default_dtype(dtype):
        return Mask2FormerForUniversalSegmentation(config)


def reward_networks(cfg: Config) -> SimpleNamespace | None:
    """The networks of ``cfg.reward`` that run on the GPU (call inside :func:`fake_building`), with where
    the reward options put them: ``SimpleNamespace(name, modules, clip, dtype, placement)``; None for a
    reward without a network we know (the built-in ones, ``jpeg_*``, ``ocr``, ``remote``, a mix)."""
    import json

    name = cfg.reward
    if name not in REWARD_CLIPS:
        return None
    options = (json.loads(cfg.reward_options) if cfg.reward_options else {}).get(name, {})
    dtype_name = options.get("dtype", REWARD_DTYPE[name])
    dtype = torch.bfloat16 if dtype_name in ("bfloat16", "bf16") else torch.float32
    clip = clip_model(REWARD_CLIPS[name], dtype)
    modules = [clip] + ([geneval_detector(torch.float32)] if name == "geneval" else [])
    placement = reward_placement(cfg)
    batch = int(options.get("batch_size", 32))
    return SimpleNamespace(
        name=name, modules=modules, clip=clip, dtype=dtype, placement=placement, batch=batch
    )


def reward_placement(cfg: Config) -> str:
    """Where ``cfg``'s reward options put its networks: ``"cpu"`` (``device``), ``"offload"``
    (``offload``: on the GPU only while scoring) or ``"device"``."""
    import json

    options = (json.loads(cfg.reward_options) if cfg.reward_options else {}).get(cfg.reward, {})
    if str(options.get("device", "cuda")) == "cpu":
        return "cpu"
    return "offload" if options.get("offload") else "device"
