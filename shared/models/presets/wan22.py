"""The wan22 family's tiny preset (`wan22.py`): real classes at a tiny config, weights drawn from torch's
seeded RNG, tokenizers built here or in vt.shared.models.tiny; `parts(task)` are the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.presets.wan import flow_unipc_scheduler, tiny_wan_transformer, tiny_wan_vae
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """Two 2-layer experts (different weights), the tiny Wan VAE and UMT5; WanPipeline layout
    (boundary 0.875), or for "i2v" WanImageToVideoPipeline's (36-channel experts, no image encoder,
    boundary 0.9), as T2V-A14B and I2V-A14B."""
    i2v = task == "i2v"
    vae = tiny_wan_vae()
    high, low = (tiny_wan_transformer(in_channels=36 if i2v else 16, out_channels=16) for _ in range(2))
    return dict(tokenizer=build_t5_tokenizer(), text_encoder=tiny_t5_encoder(umt5=True), vae=vae,
                scheduler=flow_unipc_scheduler(3.0), transformer=high, transformer_2=low,
                boundary_ratio=0.9 if i2v else 0.875)
