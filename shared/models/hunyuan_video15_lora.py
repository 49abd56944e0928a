"""HunyuanVideo 1.5's LoRA files (its export role): the key tables to ComfyUI's (Tencent's) module names, and
`load_lora`, the loader diffusers lacks for its pipelines, reading either file vt exports."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from vt.shared.errors import UserError
from vt.shared.models import comfy

# diffusers module -> original (Tencent) module, `{}` the block index (convert_hunyuan_video1_5_to_diffusers.py),
# which ComfyUI's LoRA keys for its HunyuanVideo 1.5 model take (tests/comfy_reference.py).
NAMES: tuple[tuple[str, str], ...] = (
    ("transformer_blocks.{}.attn.to_out.0", "double_blocks.{}.img_attn_proj"),
    ("transformer_blocks.{}.attn.to_add_out", "double_blocks.{}.txt_attn_proj"),
    ("transformer_blocks.{}.ff.net.0.proj", "double_blocks.{}.img_mlp.fc1"),
    ("transformer_blocks.{}.ff.net.2", "double_blocks.{}.img_mlp.fc2"),
    ("transformer_blocks.{}.ff_context.net.0.proj", "double_blocks.{}.txt_mlp.fc1"),
    ("transformer_blocks.{}.ff_context.net.2", "double_blocks.{}.txt_mlp.fc2"),
)


# Each stream's q/k/v: one module in ComfyUI's model (comfy/ldm/flux/layers.py DoubleStreamBlock `img_attn.qkv`,
# LoRA key `img_attn_qkv`); Tencent's checkpoint keeps them apart (SEPARATE_QKV, read back only).
FUSED_QKV: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("transformer_blocks.{}.attn", ("to_q", "to_k", "to_v"), "double_blocks.{}.img_attn_qkv"),
    ("transformer_blocks.{}.attn", ("add_q_proj", "add_k_proj", "add_v_proj"), "double_blocks.{}.txt_attn_qkv"),
)
SEPARATE_QKV: tuple[tuple[str, str], ...] = (
    ("transformer_blocks.{}.attn.to_q", "double_blocks.{}.img_attn_q"),
    ("transformer_blocks.{}.attn.to_k", "double_blocks.{}.img_attn_k"),
    ("transformer_blocks.{}.attn.to_v", "double_blocks.{}.img_attn_v"),
    ("transformer_blocks.{}.attn.add_q_proj", "double_blocks.{}.txt_attn_q"),
    ("transformer_blocks.{}.attn.add_k_proj", "double_blocks.{}.txt_attn_k"),
    ("transformer_blocks.{}.attn.add_v_proj", "double_blocks.{}.txt_attn_v"),
)


def load_lora(pipeline, path, adapter_name: str | None = None) -> None:
    """Load a LoRA file vt exported for HunyuanVideo 1.5 into `pipeline.transformer` (diffusers has no
    loader for this pipeline): the diffusers file (`transformer.<module>.lora_A.weight` with its rank and
    alpha in the metadata) or the ComfyUI file (`diffusion_model.<original module>...`, the scale in
    lora_B), whose original names are mapped back to diffusers' through the same tables that wrote them:
    each fused q/k/v LoRA (`img_attn_qkv`) split into its parts' own, or separate q/k/v (`img_attn_q`, the
    files vt wrote before) as they are."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as handle:
        keys = list(handle.keys())
        metadata = handle.metadata() or {}
        state = {key: handle.get_tensor(key) for key in keys}
    if all(key.startswith(comfy.PREFIX) for key in keys):
        transformer = pipeline.transformer
        try:
            renamed = comfy.diffusers_state_dict(state, comfy.templated(NAMES + SEPARATE_QKV, reverse=True),
                                                 comfy.fused_templates(FUSED_QKV, reverse=True),
                                                 out_features=lambda name: transformer.get_submodule(name).out_features)
        except ValueError as err:
            raise UserError(f"{path.name}: {err}: not a LoRA weight of a HunyuanVideo 1.5 module vt knows "
                             "(double_blocks.N.img_attn_qkv or img_attn_q/k/v ... txt_mlp.fc2)") from err
        transformer.load_lora_adapter({f"transformer.{key}": value for key, value in renamed.items()},
                                      prefix="transformer", adapter_name=adapter_name)
        return
    adapter_metadata = json.loads(metadata["lora_adapter_metadata"]) if "lora_adapter_metadata" in metadata else None
    with warnings.catch_warnings():  # peft: the refiner exclusion in the metadata found nothing to exclude
        warnings.filterwarnings("ignore", message=".*no modules were excluded.*")
        pipeline.transformer.load_lora_adapter(state, prefix="transformer", adapter_name=adapter_name,
                                               metadata=adapter_metadata)
