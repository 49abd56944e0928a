"""Frozen base weights quantized as they are read (`frozen_base.quantize`): NF4 and int8, for a LoRA on any device.

- NF4 (QLoRA's 4-bit NormalFloat): each block of 64 input weights of a row is scaled by its absolute maximum and
  each value stored as the index of the nearest of 16 levels, the quantiles of a standard normal (`NF4_LEVELS`, the
  published table bitsandbytes uses), two codes a byte: 0.5 bytes a weight plus a float32 absmax per 64 (0.5625 in
  all). Dequantized: LEVELS[code] x absmax.
- int8: one scale per output feature, absmax / 127, values rounded: 1 byte a weight plus a float32 per row.

`QuantizingWeights` wraps a component's weights (`Weights`, a single file) and presents its 2-D linear weights as
stored quantized (`quantized_modules`, `read_packed`, `scale`), computing each from the full-precision block once, so
the trainer's packed layers (train/packed_base.py) fill from it as from a GGUF or int8 file.
"""

from __future__ import annotations

import torch

from vt.shared.weights.packing import INT8, Packing

NF4 = "nf4"
NF4_BLOCK = 64
NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)
KINDS = (NF4, INT8)


def quantize_nf4(weight: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 (out, in / 2), absmax float32 (out, in / 64)) of a 2-D weight whose rows are whole blocks,
    `chunk` rows at a time (the float32 and index temporaries of a few rows, never of the whole weight)."""
    rows, width = weight.shape
    codes = torch.empty(rows, width // 2, dtype=torch.uint8)
    absmax = torch.empty(rows, width // NF4_BLOCK, dtype=torch.float32)
    midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    for start in range(0, rows, chunk):
        blocks = weight[start : start + chunk].float().reshape(-1, width // NF4_BLOCK, NF4_BLOCK)
        peak = blocks.abs().amax(dim=2).clamp_min(torch.finfo(torch.float32).tiny)
        index = torch.bucketize((blocks / peak.unsqueeze(-1)).reshape(-1, width), midpoints, out_int32=True)
        codes[start : start + chunk] = (index[:, 0::2] | (index[:, 1::2] << 4)).to(torch.uint8)  # the nearest levels
        absmax[start : start + chunk] = peak
    return codes, absmax


# byte -> its two values (low nibble first): one lookup per byte, no index tensor of a weight's size in int64
NF4_PAIRS = torch.stack([NF4_LEVELS.repeat(16), NF4_LEVELS.repeat_interleave(16)], dim=1)
_PAIRS_ON: dict[torch.device, torch.Tensor] = {torch.device("cpu"): NF4_PAIRS}


def pairs_on(device: torch.device) -> torch.Tensor:
    """NF4_PAIRS on `device`, copied there once per process: a dequantize per matmul (hundreds a step) reads it
    where it is, with no host copy and no wait for one."""
    if device not in _PAIRS_ON:
        _PAIRS_ON[device] = NF4_PAIRS.to(device)
    return _PAIRS_ON[device]


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) weight of `quantize_nf4`'s codes and absmax, in `dtype`: the codes looked up as int32 byte
    indices (2 bytes a weight) into float32 values (4), scaled in place, then cast."""
    rows = codes.shape[0]
    values = torch.nn.functional.embedding(codes.int(), pairs_on(codes.device)).reshape(rows, -1, NF4_BLOCK)
    return values.mul_(absmax.unsqueeze(-1).float()).reshape(rows, -1).to(dtype)


def quantize_int8_rows(weight: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale (out, 1)): absmax / 127 per output feature, `chunk` rows at a time."""
    values = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], 1, dtype=torch.float32)
    for start in range(0, weight.shape[0], chunk):
        rows = weight[start : start + chunk].float()
        part = (rows.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        values[start : start + chunk] = (rows / part).round().clamp(-127, 127).to(torch.int8)
        scale[start : start + chunk] = part
    return values, scale


def packing(kind: str, rows: int, width: int) -> Packing | None:
    """How a (rows, width) weight is stored as `kind`; None where it cannot be (NF4: a width not of whole blocks)."""
    if kind == NF4:
        return Packing(NF4, width // 2, (rows, width // NF4_BLOCK)) if width % NF4_BLOCK == 0 else None
    return Packing(INT8, width, (rows, 1))


class QuantizingWeights:
    """`weights` with its 2-D `.weight` tensors presented as stored in `kind` (NF4 or int8); the rest as they are."""

    def __init__(self, weights, kind: str):
        if kind not in KINDS:
            raise ValueError(f"unknown base quantization {kind!r}; use one of {KINDS}")
        self.weights, self.kind = weights, kind
        self._modules: dict[str, Packing] | None = None
        self._scales: dict[str, torch.Tensor] = {}  # a weight's scale, from its quantization until it is read

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def __getattr__(self, name: str):  # names, shape, read, scaled_modules ...: the wrapped weights'
        return getattr(self.weights, name)

    def quantized_modules(self) -> dict[str, Packing]:
        if self._modules is None:
            self._modules = {}
            for name in self.weights.names():
                shape = self.weights.shape(name)
                stored = packing(self.kind, *shape) if name.endswith(".weight") and len(shape) == 2 else None
                if stored is not None:
                    self._modules[name.removesuffix(".weight")] = stored
        return self._modules

    def _quantize(self, name: str) -> torch.Tensor:
        weight = self.weights.read(name)
        stored, self._scales[name] = quantize_nf4(weight) if self.kind == NF4 else quantize_int8_rows(weight)
        return stored

    def read_packed(self, name: str, offsets=None, shape=None) -> torch.Tensor:
        """The stored form of weight `name` (whole: a quantized base is filled in one process)."""
        stored = self._quantize(name)
        if offsets is not None and shape is not None and tuple(shape) != tuple(stored.shape):
            raise ValueError(f"{name}: a quantized base is filled whole, not by blocks (got {shape} of {stored.shape})")
        return stored

    def scale(self, name: str) -> torch.Tensor | None:
        if name.removesuffix(".weight") not in self.quantized_modules():
            return self.weights.scale(name)
        if name not in self._scales:
            self._quantize(name)
        return self._scales.pop(name)
