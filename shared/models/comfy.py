"""LoRA files in the form ComfyUI and most community tools load: the model's original module names.

diffusers names a Wan self-attention query `blocks.0.attn1.to_q`; the original checkpoint, and so
ComfyUI, calls it `blocks.0.self_attn.q`. A LoRA saved under diffusers names gives ComfyUI "lora key
not loaded". So every LoRA export also writes this file:

    diffusion_model.<original module>.lora_A.weight   (rank, in)
    diffusion_model.<original module>.lora_B.weight   (out, rank)
    diffusion_model.<original module>.alpha           (scalar), where the family's loaders read it

Each family gives its key table (`ModelSpec.original_names`): (regular expression over the
diffusers module name, replacement), first full match wins. Where a family's loaders do not take
`.alpha` (diffusers' LTX-Video conversion refuses the key), the scale alpha / rank is multiplied
into lora_B instead and no alpha is written: every loader then applies scale 1 and gets the same
weights. diffusers' own conversion of such files (`load_lora_weights`) is what the tests load them
with.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

PREFIX = "diffusion_model."
FILENAME = "lora_comfyui.safetensors"


def original_module(module: str, table: Sequence[tuple[str, str]]) -> str | None:
    """The original name of a diffusers module name, by the first pattern that matches it whole."""
    for pattern, replacement in table:
        if re.fullmatch(pattern, module):
            return re.sub(f"^{pattern}$", replacement, module)
    return None


def comfy_state_dict(lora: dict[str, Tensor], table: Sequence[tuple[str, str]], rank: int, alpha: float,
                     write_alpha: bool) -> dict[str, Tensor]:
    """peft/diffusers LoRA keys (`<module>.lora_A.weight`) -> `diffusion_model.<original>.lora_A.weight`.

    Raises ValueError naming the modules the table has no original name for.
    """
    out: dict[str, Tensor] = {}
    unmapped: set[str] = set()
    for key, tensor in lora.items():
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise ValueError(f"{key!r} is not a LoRA weight (<module>.lora_A.weight or .lora_B.weight)")
        original = original_module(module, table)
        if original is None:
            unmapped.add(module)
            continue
        tensor = tensor.detach().to("cpu", torch.float32)
        if part == "B.weight" and not write_alpha:
            tensor = tensor * (alpha / rank)
        out[f"{PREFIX}{original}.lora_{part}"] = tensor.contiguous()
        if write_alpha:
            out[f"{PREFIX}{original}.alpha"] = torch.tensor(float(alpha))
    if unmapped:
        raise ValueError(f"no original module name for {sorted(unmapped)[:4]} (LoRA on modules outside the "
                         "family's key table); the ComfyUI file is not written")
    return out
