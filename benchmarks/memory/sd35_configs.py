"""Stable Diffusion 3.5 Medium's network shapes, for random-weight stand-ins in the GPU benchmarks
(``gpu_throughput.py``, ``memory_estimate.py``, ``peer_flow_grpo.py --size medium``): no weights are
downloaded, so each script builds the networks from these configs."""

SD35_MEDIUM = {  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    **dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, pos_embed_max_size=384),
    **dict(num_layers=24, attention_head_dim=64, num_attention_heads=24, qk_norm="rms_norm"),
    **dict(joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048),
    "dual_attention_layers": tuple(range(13)),
}
"""Keywords of diffusers' ``SD3Transformer2DModel`` (24 MMDiT blocks of width 1536, 13 dual-attention)."""

SD3_VAE = {  # its vae/config.json (diffusers' defaults: 3 colour channels, SiLU, attention in the middle)
    **dict(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2),
    **dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4),
    **dict(sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, norm_num_groups=32),
    **dict(use_quant_conv=False, use_post_quant_conv=False),
}
"""Keywords of diffusers' ``AutoencoderKL`` (16 latent channels, 8× down-sampling)."""
