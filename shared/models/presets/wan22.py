"""The wan22 family's tiny preset (vt.shared.models.tiny): `parts(task)`, the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.presets.wan import flow_unipc_scheduler, tiny_wan_transformer, tiny_wan_vae
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """Two tiny Wan experts (different weights), as T2V-A14B (WanPipeline, boundary 0.875) or I2V-A14B
    (WanImageToVideoPipeline: 36-channel experts, no image encoder, boundary 0.9)."""
    i2v = task == "i2v"
    vae = tiny_wan_vae()
    high, low = (tiny_wan_transformer(in_channels=36 if i2v else 16, out_channels=16) for _ in range(2))
    return dict(
        tokenizer=build_t5_tokenizer(),
        text_encoder=tiny_t5_encoder(umt5=True),
        vae=vae,
        scheduler=flow_unipc_scheduler(3.0),
        transformer=high,
        transformer_2=low,
        boundary_ratio=0.9 if i2v else 0.875,
    )
