"""HunyuanVideo 1.5's LoRA files (its export role): the key tables to ComfyUI's (Tencent's) module names, and
`load_lora`, the loader diffusers lacks for its pipelines, reading either file vt exports."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from vt.shared.errors import UserError
from vt.shared.models.hunyuan_video import DOUBLE_BLOCK_NAMES as NAMES
from vt.shared.models.hunyuan_video import DOUBLE_BLOCK_QKV as FUSED_QKV
from vt.shared.weights import comfy

# Tencent's checkpoint keeps each stream's q/k/v apart (`double_blocks.{}.img_attn_q` ...), as vt once wrote: read only.
SEPARATE_QKV: tuple[tuple[str, str], ...] = tuple(
    (f"{prefix}.{part}", f"{fused.removesuffix('qkv')}{letter}")
    for prefix, parts, fused in FUSED_QKV
    for part, letter in zip(parts, "qkv")
)


def load_lora(pipeline, path, adapter_name: str | None = None) -> None:
    """Load a LoRA file vt exported for HunyuanVideo 1.5 into `pipeline.transformer`: the diffusers file, or the
    ComfyUI one mapped back through the tables that wrote it (fused q/k/v split, or SEPARATE_QKV's as they are)."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        state = {key: handle.get_tensor(key) for key in handle.keys()}
    if all(key.startswith(comfy.PREFIX) for key in state):
        transformer = pipeline.transformer
        try:
            renamed = comfy.diffusers_state_dict(
                state,
                comfy.templated(NAMES + SEPARATE_QKV, reverse=True),
                comfy.fused_templates(FUSED_QKV, reverse=True),
                out_features=lambda name: transformer.get_submodule(name).out_features,
            )
        except ValueError as err:
            raise UserError(
                f"{path.name}: {err}: not a LoRA weight of a HunyuanVideo 1.5 module vt knows "
                "(double_blocks.N.img_attn_qkv or img_attn_q/k/v ... txt_mlp.fc2)"
            ) from err
        transformer.load_lora_adapter(
            {f"transformer.{key}": value for key, value in renamed.items()},
            prefix="transformer",
            adapter_name=adapter_name,
        )
        return
    adapter_metadata = json.loads(metadata["lora_adapter_metadata"]) if "lora_adapter_metadata" in metadata else None
    with warnings.catch_warnings():  # peft: the refiner exclusion in the metadata found nothing to exclude
        warnings.filterwarnings("ignore", message=".*no modules were excluded.*")
        pipeline.transformer.load_lora_adapter(
            state, prefix="transformer", adapter_name=adapter_name, metadata=adapter_metadata
        )
