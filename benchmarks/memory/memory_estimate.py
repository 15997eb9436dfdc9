"""GPU memory estimates for the Wan2.1-T2V-1.3B, Qwen-Image and Z-Image recipes of docs/gpu.md (no GPU
needed).

Weights are exact: the real-size configs (the hub checkpoints' ``config.json`` values, written below)
are built on the ``meta`` device, their parameters counted, times 2 bytes (bf16; VAEs float32). The
training activations are an *extrapolation*: the H200 measurement of an SD3.5-Medium-sized pipeline
(docs/gpu.md: 49.9 GiB peak in the PPO update, ``batch_size`` 8 with CFG = 16 transformer rows, 512²,
1024 image + 333 text tokens, 24 layers of width 1536) gives bytes per (row · token · layer · channel);
each recipe's update is scaled linearly in rows, tokens, layers and width. That ignores architecture
differences (MLP ratios, cross- vs joint attention) and assumes memory-linear attention (SDPA): treat
it as ±2×. Usage: ``python benchmarks/memory/memory_estimate.py``.
"""

from __future__ import annotations

import torch
from sd35_configs import SD35_MEDIUM

GIB = 2**30
SD35_PEAK_GIB, SD35_ROWS, SD35_TOKENS, SD35_LAYERS, SD35_WIDTH = 49.9, 16, 1024 + 333, 24, 1536
WAN_1_3B = dict(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
UMT5_XXL |= dict(feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
QWEN_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28)
QWEN_VL_7B_TEXT |= dict(num_attention_heads=28, num_key_value_heads=4)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36)
QWEN3_4B |= dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128)
FLUX_VAE = dict(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2)
FLUX_VAE |= dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
QWEN_VL_7B_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584
)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_counts() -> dict[str, int]:
    """Parameter counts of every component, built on the meta device (no memory, no weights)."""
    import diffusers
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3Config,
        Qwen3Model,
        UMT5Config,
        UMT5EncoderModel,
    )

    with torch.device("meta"):
        qwen_vl = Qwen2_5_VLConfig(text_config=QWEN_VL_7B_TEXT, vision_config=QWEN_VL_7B_VISION)
        return {
            "sd35m_transformer": count(diffusers.SD3Transformer2DModel(**SD35_MEDIUM)),
            "wan_transformer": count(diffusers.WanTransformer3DModel(**WAN_1_3B)),
            "wan_text": count(UMT5EncoderModel(UMT5Config(**UMT5_XXL))),
            "wan_vae": count(diffusers.AutoencoderKLWan()),
            "qwen_transformer": count(diffusers.QwenImageTransformer2DModel()),
            "qwen_text": count(Qwen2_5_VLForConditionalGeneration(qwen_vl)),
            "qwen_vae": count(diffusers.AutoencoderKLQwenImage()),
            "z_transformer": count(diffusers.ZImageTransformer2DModel()),
            "z_text": count(Qwen3Model(Qwen3Config(**QWEN3_4B))),
            "z_vae": count(diffusers.AutoencoderKL(**FLUX_VAE)),
        }


def activation_gib(rows: int, tokens: int, layers: int, width: int, per_unit: float) -> float:
    return rows * tokens * layers * width * per_unit / GIB


def main() -> None:
    n = build_counts()
    per_unit = (SD35_PEAK_GIB - 2 * n["sd35m_transformer"] / GIB) * GIB
    per_unit /= SD35_ROWS * SD35_TOKENS * SD35_LAYERS * SD35_WIDTH
    print(f"SD3.5-M calibration: {per_unit:.1f} bytes per row·token·layer·channel in the update")
    for name, p in n.items():
        print(f"{name:>18}: {p / 1e9:6.3f} B parameters")
    recipes = {  # (transformer, text encoder, vae, rows, tokens, layers, width)
        "wan 33×320×320, batch 2 (4 rows with CFG)": ("wan", 2 * 2, 9 * 20 * 20, 30, 1536),
        "wan 81×480×832, batch 1 (2 rows with CFG)": ("wan", 1 * 2, 21 * 30 * 52, 30, 1536),
        "qwen 512², batch 2 (4 rows with true CFG)": ("qwen", 2 * 2, 32 * 32 + 128, 60, 3072),
        "qwen 1024², batch 1 (2 rows with true CFG)": ("qwen", 1 * 2, 64 * 64 + 128, 60, 3072),
        "z_image 512², batch 2 (4 rows with CFG)": ("z", 2 * 2, 32 * 32 + 128, 32, 3840),
        "z_image 1024², batch 1 (2 rows with CFG)": ("z", 1 * 2, 64 * 64 + 128, 32, 3840),
    }
    for label, (m, rows, tokens, layers, width) in recipes.items():
        weights = (2 * (n[f"{m}_transformer"] + n[f"{m}_text"]) + 4 * n[f"{m}_vae"]) / GIB
        act = activation_gib(rows, tokens, layers, width, per_unit)
        print(f"{label}: weights {weights:.1f} GiB + update activations ≈ {act:.0f} GiB")


if __name__ == "__main__":
    main()
