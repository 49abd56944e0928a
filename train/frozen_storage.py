"""Frozen weights stored narrower than they compute: float8 base weights, bf16 weights in a float32 run.

A LoRA's frozen base may be kept in a dtype it does not compute in: float8 e4m3 (`frozen_base.fp8`,
half of bf16) under bf16 autocast, or bf16 in a run without autocast (a CPU, where bf16 matmuls without
bf16 instructions run far slower than float32 ones). `store_frozen` stores the linear and conv weights
in the storage dtype and everything diffusers' layerwise casting skips (norms, embeddings, the input
and output projections) in the compute dtype, the class's float32 modules in float32. Then:

- in one process each frozen Linear becomes a `StoredLinear`: its weight stays in the storage dtype and
  is upcast for each matmul only, forward and backward (`_UpcastLinear` keeps the stored weight for the
  backward, not an upcast copy), so no layer ever holds a second copy of its weight between uses. The
  few conv layers left (rare in transformer blocks) get diffusers' layerwise-casting hooks;
- under FSDP2, bf16 storage in a float32 run is gathered as stored (half the all-gather's bytes and
  buffers) and upcast by the same StoredLinear; float8 storage is upcast by the all-gather itself (the
  param dtype is the compute dtype), since collectives in float8 are not available everywhere.

A single fp8-scaled file (ComfyUI's: float8 weights with a per-tensor scale, shared/weights/single_file.py) keeps
its weights with fp8 base weights: each such Linear is a StoredLinear with a `weight_scale` buffer (non-persistent:
not a parameter, in no state dict, checkpoint or export) that multiplies the upcast weight, forward and backward,
as ComfyUI computes it (`weight.to(dtype) * scale`), in one process and under FSDP2 alike (there the all-gather
upcasts the float8 values exactly and the layer applies the scale). The fill stores the file's float8 values and
scale as they are.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from vt.shared.log import get_logger

log = get_logger("vt.train.frozen")
CAST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # the layer kinds diffusers' layerwise casting stores


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as stored."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def skip_patterns(model: nn.Module) -> tuple[str, ...]:
    """The layers kept in their dtype, as diffusers' `enable_layerwise_casting` chooses them: its defaults
    (embeddings, norms, the input and output projections, so the model's `.dtype` stays a compute
    dtype), the class's fp32 modules and the class's own skip patterns."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    return (
        *DEFAULT_SKIP_MODULES_PATTERN,
        *(getattr(model, "_keep_in_fp32_modules", None) or ()),
        *(getattr(model, "_skip_layerwise_casting_patterns", None) or ()),
    )


class _UpcastLinear(torch.autograd.Function):
    """y = x W^T + b with a frozen W (and b) stored narrower than `dtype`: upcast for the product, and
    upcast again in the backward from the stored W, which is all that is kept."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, scale):
        ctx.save_for_backward(weight, scale)
        ctx.dtype = dtype
        return F.linear(x.to(dtype), upcast(weight, dtype, scale), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        return grad.to(ctx.dtype) @ upcast(weight, ctx.dtype, scale), None, None, None, None


def upcast(weight: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A stored weight in `dtype`, times its per-tensor scale where it has one (fp8-scaled files)."""
    wide = weight.to(dtype)
    if scale is None:
        return wide
    scale = scale.to(dtype)
    return wide * scale if wide is weight else wide.mul_(scale)  # in place on an upcast copy


class StoredLinear(nn.Linear):
    """A frozen Linear whose weight is stored in a narrow dtype and computed in `compute_dtype`."""

    compute_dtype: torch.dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UpcastLinear.apply(x, self.weight, self.bias, self.compute_dtype, self._buffers.get("weight_scale"))


def store_frozen(
    model: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    sharded: bool,
    gather_stored: bool = False,
    scaled: Collection[str] = (),
) -> int:
    """Store the frozen linear and conv weights of `model` (before LoRA is added) in `storage_dtype`, computed
    in `compute_dtype` (see the module docstring). `sharded`: FSDP2 will shard it; it upcasts on all-gather
    unless `gather_stored`, where it gathers the stored dtype (half the bytes) and the linears upcast per
    matmul as in one process (the convs, rare in blocks, then hold the compute dtype). `scaled`: the linears
    whose float8 weight comes with a per-tensor scale (fp8 storage only); each stored narrow gets a
    `weight_scale` buffer (NaN until the fill reads it) and applies it, sharded or not, and keeps its bias (not
    float8 in the file) in the compute dtype. Returns the bytes saved."""
    from vt.shared.models.components import keeps_float32

    before = weight_bytes(model)
    skip = skip_patterns(model)
    upcast_here = not sharded or gather_stored  # else FSDP2's all-gather upcasts
    for name, module in model.named_modules():
        castable = isinstance(module, CAST_LAYERS) and not any(re.search(p, name) for p in skip)
        linear = castable and type(module) is nn.Linear
        narrow = castable and (linear or not (sharded and gather_stored))
        with_scale = narrow and linear and name in scaled and storage_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        for local, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and not keeps_float32(model, f"{name}.{local}"):
                stored = narrow and not (with_scale and local != "weight")  # a scaled layer's bias: as the file has it
                param.data = param.data.to(storage_dtype if stored else compute_dtype)
        if linear and (upcast_here or with_scale):
            module.__class__ = StoredLinear
            module.compute_dtype = compute_dtype
        if with_scale:
            module.register_buffer("weight_scale", torch.full((), float("nan")), persistent=False)
    if not sharded:  # hooks for the convs; the linears upcast themselves
        from diffusers.hooks import apply_layerwise_casting

        apply_layerwise_casting(
            model, storage_dtype, compute_dtype, skip_modules_pattern=skip, skip_modules_classes=(nn.Linear,)
        )
    saved = before - weight_bytes(model)
    log.info(
        "frozen transformer stored in %s, computed in %s (%.1f MB -> %.1f MB)",
        str(storage_dtype).removeprefix("torch."),
        str(compute_dtype).removeprefix("torch."),
        before / 1e6,
        (before - saved) / 1e6,
    )
    return saved
