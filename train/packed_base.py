"""A LoRA's frozen base kept as its file stores it (GGUF blocks Q8_0 ... Q4_K, int8 with scales), dequantized per matmul.

A transformer read from a quantized single file (a GGUF file, shared/weights/gguf_file.py; ComfyUI's int8 layers,
single_file.py) trains a LoRA on the file's own values: each linear layer whose weight the file stores quantized
becomes a `PackedLinear`, its weight a frozen parameter of the stored form: uint8 (out features, bytes per row) of
ggml blocks, 0.56-1.06 bytes a weight against bf16's 2, or int8 values with their per-tensor or per-row scale.
Each matmul dequantizes the weight into the compute dtype on the device (shared/weights/gguf_quants.py), forward
and backward; the backward keeps the blocks, never a dequantized copy, as float8 storage does
(train/frozen_storage.py). So the model computes exactly what the dequantized model computes, in less memory.

One process only: under FSDP2 or tensor parallel the file is dequantized into `model.dtype` at fill time instead
(a sharded layout already divides the weights by its degree); the log says which.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from vt.shared.weights.gguf_quants import dequantize
from vt.shared.weights.packing import INT8, Packing
from vt.shared.weights.quantize import NF4, dequantize_nf4, packing
from vt.train.frozen_storage import skip_patterns


def unpack(packed: torch.Tensor, kind: int | str, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """A stored weight's values in `dtype`: ggml blocks dequantized, NF4 codes by their levels and block absmax, or
    int8 values times their scale."""
    if kind == INT8:
        return packed.to(dtype) * scale.to(dtype)
    if kind == NF4:
        return dequantize_nf4(packed, scale, dtype)
    return dequantize(packed, kind, dtype)


_UNPACK_PEAKS: dict[tuple, int] = {}


def unpack_peak(module: "PackedLinear") -> int:
    """The most bytes `unpack` holds at once for `module`'s weight (the dequantize's temporaries and its result in
    the compute dtype), measured on fake tensors, once per kind, shape and dtype: what each matmul of the layer adds,
    forward and backward (`vt-train plan` counts the widest layer's)."""
    from vt.shared.memory_trace import fake_mode, peak_bytes

    scale = module._buffers.get("weight_scale")
    key = (module.kind, tuple(module.weight.shape), module.compute_dtype, None if scale is None else tuple(scale.shape))
    if key not in _UNPACK_PEAKS:
        with fake_mode(), peak_bytes() as peak:
            packed = torch.empty(module.weight.shape, dtype=module.weight.dtype)
            scales = None if scale is None else torch.empty(scale.shape, dtype=scale.dtype)
            unpack(packed, module.kind, module.compute_dtype, scales)
        _UNPACK_PEAKS[key] = peak.peak
    return _UNPACK_PEAKS[key]


def linear_packings(model: nn.Module, kind: str) -> dict[str, Packing]:
    """How `frozen_base.quantize` stores each Linear of `model` (built on the meta device): its names -> Packing."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (stored := packing(kind, module.out_features, module.in_features)):
            out[name] = stored
    return out


class _DequantLinear(torch.autograd.Function):
    """y = x W^T + b with W the frozen weight `packed` as its file stores it (`kind`, `scale`), unpacked into
    `dtype` for the product, forward and backward; only the stored weight is kept for the backward."""

    @staticmethod
    def forward(ctx, x, packed, bias, dtype, kind, scale):
        ctx.save_for_backward(packed, scale)
        ctx.dtype, ctx.kind = dtype, kind
        return F.linear(x.to(dtype), unpack(packed, kind, dtype, scale), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        packed, scale = ctx.saved_tensors
        return grad.to(ctx.dtype) @ unpack(packed, ctx.kind, ctx.dtype, scale), None, None, None, None, None


class PackedLinear(nn.Linear):
    """A frozen Linear whose weight is its file's quantized form: ggml blocks (uint8, a row of blocks per output
    feature) or int8 values with a `weight_scale` buffer (non-persistent: in no state dict, checkpoint or export)."""

    compute_dtype: torch.dtype = torch.float32
    kind: int | str = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantLinear.apply(
            x, self.weight, self.bias, self.compute_dtype, self.kind, self._buffers.get("weight_scale")
        )


def pack_frozen(model: nn.Module, packed: dict[str, Packing], compute_dtype: torch.dtype) -> int:
    """Make each Linear of `model` named in `packed` a PackedLinear whose weight is an empty parameter of the stored
    form (uint8 blocks or int8 values, filled from the file by `read_packed`; an int8 one's scale buffer NaN until the
    fill reads it), its bias in `compute_dtype`; before the adapters are added. The layers diffusers' layerwise
    casting keeps in their dtype (embeddings, norms, the input and output projections: the model reads some of their
    dtypes to cast its inputs) are left to be filled dequantized. After `store_frozen`, whose storage it replaces
    for these layers. Returns how many layers it packed."""
    skip = skip_patterns(model)
    count = 0
    for name, module in model.named_modules():
        if name not in packed or not isinstance(module, nn.Linear) or any(re.search(p, name) for p in skip):
            continue
        kind, row_bytes, scale = packed[name]
        dtype = torch.int8 if kind == INT8 else torch.uint8  # NF4: two 4-bit codes a byte
        module.weight = nn.Parameter(
            torch.empty((module.out_features, row_bytes), dtype=dtype, device=module.weight.device), requires_grad=False
        )
        if scale is not None:
            # where the weight is (the meta device: made on the device it trains on, never whole on the host)
            module.register_buffer(
                "weight_scale", torch.full(scale, float("nan"), device=module.weight.device), persistent=False
            )
        if module.bias is not None:
            module.bias.data = module.bias.data.to(compute_dtype)
        module.__class__ = PackedLinear
        module.compute_dtype, module.kind = compute_dtype, kind
        count += 1
    return count
