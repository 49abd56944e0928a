"""Model Spec registry: one spec class per family, looked up by the name in `model.family`.

Registering is one line in `_REGISTRY`; family modules are imported only when asked for, so
reading a config does not pay for importing diffusers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vt.shared.config import ModelConfig
from vt.shared.errors import UserError

if TYPE_CHECKING:
    from vt.shared.config import Config
    from vt.shared.models.spec import ModelSpec

# family name -> "module:class"
_REGISTRY: dict[str, str] = {
    "ltx-video": "vt.shared.models.ltx_video:LTXVideoSpec",
    "wan": "vt.shared.models.wan:WanSpec",
    "wan2.2": "vt.shared.models.wan22:Wan22Spec",
    "wan2.2-ti2v": "vt.shared.models.wan22_ti2v:Wan22TI2VSpec",
    "cogvideox": "vt.shared.models.cogvideox:CogVideoXSpec",
    "hunyuan-video": "vt.shared.models.hunyuan_video:HunyuanVideoSpec",
    "hunyuan-video-1.5": "vt.shared.models.hunyuan_video15:HunyuanVideo15Spec",
    "ltx-2": "vt.shared.models.ltx2:LTX2Spec",
    "mochi": "vt.shared.models.mochi:MochiSpec",
    "kandinsky5": "vt.shared.models.kandinsky5:Kandinsky5Spec",
    "kandinsky6": "vt.shared.models.kandinsky6:Kandinsky6Spec",
    "skyreels-v2": "vt.shared.models.skyreels_v2:SkyReelsV2Spec",
    "wan-vace": "vt.shared.models.wan_vace:WanVACESpec",
    "minimax-h3": "vt.shared.models.minimax_h3:MiniMaxH3Spec",
}
FAMILIES: tuple[str, ...] = tuple(_REGISTRY)


def get_spec_class(family: str) -> type["ModelSpec"]:
    """The spec class registered as `family`; unknown names raise ValueError listing the known ones."""
    if family not in _REGISTRY:
        raise UserError(f"model.family = {family!r} is not a registered model family; choose one of {list(FAMILIES)}")
    module, name = _REGISTRY[family].split(":")
    return getattr(importlib.import_module(module), name)


def build_spec(config: ModelConfig, frame_rate: float) -> "ModelSpec":
    """The spec for `config.family`, configured by `config`, for frames sampled at `frame_rate` (buckets.fps)."""
    return get_spec_class(config.family)(config, frame_rate)


def spec_for(config: "Config") -> "ModelSpec":
    """The spec a run config describes: its model section at its bucket frame rate."""
    return build_spec(config.model, config.buckets.fps)
