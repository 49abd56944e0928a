"""The skyreels_v2 family's tiny preset (`skyreels_v2.py`): real classes at a tiny config, weights drawn from torch's
seeded RNG, tokenizers built here or in vt.shared.models.tiny; `parts(task)` are the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.presets import wan
from vt.shared.models.presets.wan import flow_unipc_scheduler, tiny_image_parts, tiny_wan_vae
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


INDEX_NAMES = wan.INDEX_NAMES  # i2v: Wan 2.1's CLIP image processor


def parts(task: str) -> dict[str, Any]:
    """The Wan tiny sizes on SkyReelsV2Transformer3DModel (4 heads x 16, 2 layers, text width 64), the
    tiny Wan VAE and UMT5; t2v: SkyReelsV2Pipeline's layout (the T2V and DF-14B transformer layout;
    the DF pipelines take it too); i2v: SkyReelsV2ImageToVideoPipeline's (36 channels, image
    projections, a 2-layer CLIP vision encoder and its processor). UniPC flow schedulers at the
    pipelines' documented shifts (8 for t2v, 5 for i2v)."""
    i2v = task == "i2v"
    heads, head_dim, z_dim, image_dim = 4, 16, 16, 32
    image = dict(in_channels=2 * z_dim + 4, image_dim=image_dim, added_kv_proj_dim=heads * head_dim) if i2v \
        else dict(in_channels=z_dim)
    transformer = tiny_skyreels_transformer(out_channels=z_dim, **image)
    parts = tiny_image_parts(image_dim) if i2v else {}
    return dict(tokenizer=build_t5_tokenizer(), text_encoder=tiny_t5_encoder(umt5=True), vae=tiny_wan_vae(z_dim),
                scheduler=flow_unipc_scheduler(5.0 if i2v else 8.0), transformer=transformer, **parts)


def tiny_skyreels_transformer(**config):
    """A 2-layer SkyReels V2 transformer of 4 heads x 16 (patch 1x2x2, text width 64), as the tiny Wan one."""
    from diffusers import SkyReelsV2Transformer3DModel

    return SkyReelsV2Transformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16,
                                        text_dim=64, freq_dim=256, ffn_dim=128, num_layers=2, rope_max_seq_len=64,
                                        **config)
