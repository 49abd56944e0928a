"""How a file stores a quantized weight that a LoRA's frozen base keeps as it is (train/packed_base.py)."""

from __future__ import annotations

from typing import NamedTuple

INT8 = "int8"  # int8 values times a scale (per tensor, or per output feature): ComfyUI's int8_tensorwise and kin


class Packing(NamedTuple):
    kind: int | str  # a ggml block type (gguf_quants.py), or INT8
    row_bytes: int  # bytes of one stored row (one output feature)
    scale: tuple[int, ...] | None = None  # an INT8 weight's scale shape: () per tensor, (out, 1) per row
