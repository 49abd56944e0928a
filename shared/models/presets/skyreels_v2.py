"""The skyreels_v2 family's tiny preset (vt.shared.models.tiny): `parts(task)`, the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.presets import wan
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder

INDEX_NAMES = wan.INDEX_NAMES  # i2v: Wan 2.1's CLIP image processor


def parts(task: str) -> dict[str, Any]:
    """The tiny Wan parts on SkyReelsV2Transformer3DModel in SkyReelsV2Pipeline's layout (the DF pipelines' too) or
    the I2V one's (as Wan 2.1 I2V), with UniPC at the pipelines' documented shifts (8 for t2v, 5 for i2v)."""
    i2v = task == "i2v"
    transformer = tiny_skyreels_transformer(out_channels=16, **wan.image_channels(i2v))
    parts = wan.tiny_image_parts(32) if i2v else {}
    return dict(
        tokenizer=build_t5_tokenizer(),
        text_encoder=tiny_t5_encoder(umt5=True),
        vae=wan.tiny_wan_vae(),
        scheduler=wan.flow_unipc_scheduler(5.0 if i2v else 8.0),
        transformer=transformer,
        **parts,
    )


def tiny_skyreels_transformer(**config):
    from diffusers import SkyReelsV2Transformer3DModel

    return SkyReelsV2Transformer3DModel(**wan.TINY_DIT, **config)
