"""LoHa and LoKr files in the form ComfyUI loads: the model's original module names (comfy.py's key tables).

    diffusion_model.<original module>.hada_w1_a, .hada_w1_b, .hada_w2_a, .hada_w2_b     (LoHa)
    diffusion_model.<original module>.lokr_w1 (or .lokr_w1_a, .lokr_w1_b), .lokr_w2 (or _a, _b)     (LoKr)

peft's factors under peft's own part names, which are ComfyUI's (comfy/weight_adapter/loha.py and lokr.py
`load`). ComfyUI scales a LoHa by alpha / rank with a `.alpha` key, by 1 without; a LoKr by alpha / rank only
where a factor is split into _a/_b, and by 1 for two whole factors, whatever `.alpha` says. So no `.alpha` is
written and peft's scale alpha / r is multiplied into the first factor (hada_w1_a, lokr_w1 or lokr_w1_a): every
ComfyUI form then adds (w1_a w1_b) * (w2_a w2_b) or kron(w1, w2) times peft's scale, as peft does.
tests/shared/test_adapters.py checks the files against ComfyUI's arithmetic (tests/helpers/comfy_reference.py).

Not written (the caller logs it; the diffusers file is the one to load):
- DoRA: ComfyUI's `dora_scale` (comfy/weight_adapter/base.py `weight_decompose`) rescales each input column of
  W + delta to the file's magnitude, a (1, in) tensor (LyCORIS' convention); peft's magnitude rescales each
  output row, (out,). No ComfyUI DoRA key holds peft's adapted weight.
- Families whose original model fuses modules diffusers keeps apart (`Fused` entries: HunyuanVideo, HunyuanVideo
  1.5, MiniMax H3, Mochi): a LoRA of the parts stacks into one LoRA of the fused module, but a Hadamard or
  Kronecker product of the parts is no product of the same form on the fused weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vt.shared.adapters import module_of, part_of
from vt.shared.weights.comfy import PREFIX, Fused, original_module

# Each kind's part names start so; the factor peft's scale alpha / r is multiplied into (a LoKr's w1 is whole or
# split into _a/_b).
PART_PREFIX = {"loha": "hada_", "lokr": "lokr_"}
FIRST_FACTOR = {"loha": ("hada_w1_a",), "lokr": ("lokr_w1", "lokr_w1_a")}


def comfy_state_dict(
    kind: str,
    tensors: dict[str, Tensor],
    table: Sequence[tuple[str, str]],
    rank: int,
    alpha: float,
    fused: Sequence[Fused] = (),
) -> dict[str, Tensor]:
    """peft's saved LoHa or LoKr weights (`<module>.hada_w1_a` ...) -> `diffusion_model.<original>.hada_w1_a`
    ..., peft's scale alpha / `rank` in the first factor. Raises ValueError for a kind ComfyUI would load
    differently (DoRA), a family with fused modules, or modules the key table has no original name for."""
    if kind not in FIRST_FACTOR:
        raise ValueError(
            f"no ComfyUI file for a {kind} adapter: ComfyUI's DoRA rescales the weight's input "
            "columns, peft's its output rows, so it would load other weights"
        )
    if fused:
        raise ValueError(
            f"the family's original model fuses modules diffusers keeps apart, and a {kind} of the "
            f"parts is not a {kind} of the fused module"
        )
    out: dict[str, Tensor] = {}
    unmapped: set[str] = set()
    scale = alpha / rank
    for key, tensor in tensors.items():
        part = part_of(key)
        if part is None or not part.startswith(PART_PREFIX[kind]):
            raise ValueError(f"{key!r} is not a {kind} weight")
        module = module_of(key)
        original = original_module(module, table)
        if original is None:
            unmapped.add(module)
            continue
        tensor = tensor.detach().to("cpu", torch.float32)
        if part in FIRST_FACTOR[kind]:
            tensor = tensor * scale
        out[f"{PREFIX}{original}.{part}"] = tensor.contiguous()
    if unmapped:
        raise ValueError(
            f"no original module name for {sorted(unmapped)[:4]} ({kind} on modules outside the "
            "family's key table); the ComfyUI file is not written"
        )
    return out
