"""The wan_vace family's tiny preset (vt.shared.models.tiny): `parts(task)`, the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.presets.wan import TINY_DIT, flow_unipc_scheduler, tiny_wan_vae
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """Wan's tiny t2v parts with the tiny DiT as WanVACETransformer3DModel, two VACE blocks hinting both main blocks
    (vace_layers [0, 1]; 96 control channels: 2 x 16 latents + 8 x 8 mask); WanVACEPipeline layout. The VAE is Wan's
    at half the width (base_dim 8): every sample and every pipeline call encodes the control video twice over
    (inactive and reactive halves) beside the clip, and the VAE is nearly all of this family's compute."""
    from diffusers import WanVACETransformer3DModel

    transformer = WanVACETransformer3DModel(
        **TINY_DIT, in_channels=16, out_channels=16, vace_layers=[0, 1], vace_in_channels=96
    )
    return dict(
        tokenizer=build_t5_tokenizer(),
        text_encoder=tiny_t5_encoder(umt5=True),
        vae=tiny_wan_vae(base_dim=8),
        scheduler=flow_unipc_scheduler(3.0),
        transformer=transformer,
    )
