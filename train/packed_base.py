"""A LoRA's frozen base kept in the quantized blocks of its file (GGUF: Q8_0 ... Q4_K), dequantized per matmul.

A transformer read from a quantized single file (shared/weights/gguf_file.py) trains a LoRA on the file's own
values: each linear layer whose weight the file stores quantized becomes a `PackedLinear`, its weight a frozen
uint8 parameter of the file's blocks, (out features, bytes per row), 0.56-1.06 bytes a weight against bf16's 2.
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
from vt.train.frozen_storage import skip_patterns


class _DequantLinear(torch.autograd.Function):
    """y = x W^T + b with W the frozen blocks `packed` of ggml type `qtype`, dequantized into `dtype` for the
    product, forward and backward; only the blocks are kept for the backward."""

    @staticmethod
    def forward(ctx, x, packed, bias, dtype, qtype):
        ctx.save_for_backward(packed)
        ctx.dtype, ctx.qtype = dtype, qtype
        return F.linear(x.to(dtype), dequantize(packed, qtype, dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        return grad.to(ctx.dtype) @ dequantize(packed, ctx.qtype, ctx.dtype), None, None, None, None


class PackedLinear(nn.Linear):
    """A frozen Linear whose weight is its file's quantized blocks (uint8, one row of blocks per output feature)."""

    compute_dtype: torch.dtype = torch.float32
    qtype: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantLinear.apply(x, self.weight, self.bias, self.compute_dtype, self.qtype)


def pack_frozen(model: nn.Module, packed: dict[str, tuple[int, int]], compute_dtype: torch.dtype) -> int:
    """Make each Linear of `model` named in `packed` (module -> (ggml type, bytes per row)) a PackedLinear whose
    weight is an empty uint8 parameter of the packed shape (filled from the file by `read_packed`), its bias in
    `compute_dtype`; before the adapters are added. The layers diffusers' layerwise casting keeps in their dtype
    (embeddings, norms, the input and output projections: the model reads some of their dtypes to cast its inputs)
    are left to be filled dequantized. Returns how many layers it packed."""
    skip = skip_patterns(model)
    count = 0
    for name, module in model.named_modules():
        if name not in packed or type(module) is not nn.Linear or any(re.search(p, name) for p in skip):
            continue
        qtype, row_bytes = packed[name]
        module.weight = nn.Parameter(torch.empty((module.out_features, row_bytes), dtype=torch.uint8,
                                                 device=module.weight.device), requires_grad=False)
        if module.bias is not None:
            module.bias.data = module.bias.data.to(compute_dtype)
        module.__class__ = PackedLinear
        module.compute_dtype, module.qtype = compute_dtype, qtype
        count += 1
    return count
