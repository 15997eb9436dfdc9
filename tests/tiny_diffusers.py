"""Tiny random-config SD3, FLUX.1, Qwen-Image, Wan2.1 and Z-Image pipelines built offline and saved
with ``save_pretrained``.

Every component is constructed here (word-level tokenizers, 2-layer CLIP / T5 encoders, a 2-level
VAE, a 1–2 layer transformer), so the adapters load them with ``from_pretrained(local_dir)`` exactly
as they load a hub checkpoint. Images are 32×32; the VAE halves the side (latents 4×16×16). The VAE
gets non-trivial ``scaling_factor`` / ``shift_factor`` so decoding must un-scale correctly (the Qwen-Image
and Wan VAEs: non-trivial ``latents_mean`` / ``latents_std``). Wan clips are ``WAN_FRAMES`` frames of
``SIZE``² (latents 4×2×4×4: the VAE divides time by 4 and space by 8).
``train_config`` makes the tiny one-iteration trainer config of the end-to-end tests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

WORDS = "a an the of on in red green blue yellow square circle triangle photo cat dog text sign big small"
MAX_LEN = 16
SIZE = 32  # image side in pixels
WAN_FRAMES = 5  # frames of a tiny Wan clip (4k + 1)
LATENT_MEAN, LATENT_STD = [0.1, -0.2, 0.05, 0.3], [1.5, 0.8, 1.2, 2.0]


def tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` that adds BOS/EOS and pads to ``MAX_LEN``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    vocab = {w: i for i, w in enumerate(specials + WORDS.split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 2), ("[EOS]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=MAX_LEN,
    )


def _clip_config(projection_dim: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(WORDS.split()) + 4,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_LEN,
        projection_dim=projection_dim,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )


def _t5(d_model: int = 64):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(WORDS.split()) + 4,
            d_model=d_model,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            pad_token_id=0,
            eos_token_id=3,
        )
    )


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1,
        scaling_factor=1.5,
    )


def build_sd3(directory: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``StableDiffusion3Pipeline`` (CLIP-L, CLIP-G, T5, shift 3) into ``directory``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=SIZE // 2,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=32,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(),
        text_encoder=CLIPTextModelWithProjection(_clip_config()),
        tokenizer=tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config()),
        tokenizer_2=tokenizer(),
        text_encoder_3=_t5(64),
        tokenizer_3=tokenizer(),
    )
    pipe.save_pretrained(str(directory))
    return Path(directory)


def build_flux(directory: str | Path, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """Save a tiny ``FluxPipeline`` (CLIP pooled + T5, 2×2 packed latents, dynamic shift) in ``directory``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=_vae(),
        text_encoder=CLIPTextModel(_clip_config()),
        tokenizer=tokenizer(),
        text_encoder_2=_t5(64),
        tokenizer_2=tokenizer(),
    )
    pipe.save_pretrained(str(directory))
    return Path(directory)


def build_qwen_image(directory: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``QwenImagePipeline`` (2-layer Qwen2.5-VL text encoder, 2×2 packed latents, the
    checkpoint's dynamic exponential shift with a terminal σ) in ``directory``."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(8, 4, 4),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=LATENT_MEAN,
        latents_std=LATENT_STD,
    )
    text = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2}
    text |= {"vocab_size": len(WORDS.split()) + 4, "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
    text |= {"num_key_value_heads": 2, "rope_scaling": {"mrope_section": [2, 2, 4], "rope_type": "default"}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    pipe = QwenImagePipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
        tokenizer=tokenizer(),
    )
    pipe.save_pretrained(str(directory))
    return Path(directory)


def build_wan(directory: str | Path, seed: int = 0) -> Path:
    """Save a tiny Wan2.1 text-to-video ``WanPipeline`` (T5 text encoder, 3-D VAE, shift 3) in
    ``directory``."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=64,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=LATENT_MEAN,
        latents_std=LATENT_STD,
    )
    pipe = WanPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=_t5(64),
        tokenizer=tokenizer(),
    )
    pipe.save_pretrained(str(directory))
    return Path(directory)


def build_z_image(directory: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``ZImagePipeline`` (2-layer Qwen3 text encoder behind a chat template, the SD3-style
    VAE, static shift 3) in ``directory``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        in_channels=4,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],
        axes_lens=[256, 32, 32],
    )
    text = Qwen3Config(
        vocab_size=len(WORDS.split()) + 4,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    tok = tokenizer()
    tok.chat_template = "{% for m in messages %}user: {{ m['content'] }} {% endfor %}assistant"
    pipe = ZImagePipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(),
        text_encoder=Qwen3Model(text).eval(),
        tokenizer=tok,
    )
    pipe.save_pretrained(str(directory))
    return Path(directory)


BUILDERS = {
    "sd3": build_sd3,
    "flux": build_flux,
    "qwen_image": build_qwen_image,
    "wan": build_wan,
    "z_image": build_z_image,
}
"""Every adapter's tiny pipeline builder, by ``--model`` name."""


def train_config(preset: str, kind: str, ckpt, prompts, run_dir):
    """A validated one-iteration ``Config`` of ``preset`` for the tiny ``kind`` pipeline in ``ckpt``
    (4 steps, 2 groups of 2, jpeg reward, β = 0.01)."""
    from flowcredit.presets import PRESETS
    from flowcredit.validation import validate

    extra = {"resolution": SIZE, "dtype": "float32"}
    if kind == "wan":
        extra["num_frames"] = WAN_FRAMES
    cfg = dataclasses.replace(
        PRESETS[preset](),
        model=kind,
        checkpoint=str(ckpt),
        reward="jpeg_compressibility",
        train_prompts=str(prompts),
        eval_prompts=str(prompts),
        num_steps=4,
        group_size=2,
        prompts_per_iter=2,
        batch_size=4,
        eval_every=0,
        num_eval_prompts=2,
        eval_samples_per_prompt=1,
        iterations=1,
        run_dir=str(run_dir),
        window_size=0,
        beta=0.01,
        lora_rank=4,
        lora_alpha=8.0,
        **extra,
    )
    if preset == "dense_grpo":
        cfg.calibrate = False
    if preset == "stepwise_grpo":
        cfg.window_start = 1
    return validate(cfg)  # a config error fails the test (it used to skip it)
