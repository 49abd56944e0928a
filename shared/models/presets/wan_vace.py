"""The wan_vace family's tiny preset (`wan_vace.py`): real classes at a tiny config, weights drawn from torch's
seeded RNG, tokenizers built here or in vt.shared.models.tiny; `parts(task)` are the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.presets.wan import flow_unipc_scheduler, tiny_wan_vae
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """Wan's tiny t2v parts with a 2-layer WanVACETransformer3DModel whose two VACE blocks hint both main
    blocks (vace_layers [0, 1]; 96 control channels: 2 x 16 latents + 8 x 8 mask); WanVACEPipeline layout."""
    from diffusers import WanVACETransformer3DModel

    transformer = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=64, freq_dim=256, ffn_dim=128, num_layers=2, rope_max_seq_len=64, vace_layers=[0, 1],
        vace_in_channels=96)
    return dict(tokenizer=build_t5_tokenizer(), text_encoder=tiny_t5_encoder(umt5=True), vae=tiny_wan_vae(),
                scheduler=flow_unipc_scheduler(3.0), transformer=transformer)
