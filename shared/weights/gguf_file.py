"""A GGUF file's tensors (ComfyUI-GGUF's quantized transformers) with the reading interface of `Weights`.

GGUF (the `gguf` package's format, as ComfyUI-GGUF's conversion tools write it for Wan, HunyuanVideo, LTX-Video ...)
stores each tensor as float32, float16, bfloat16 or ggml blocks (gguf_quants.py), its dims listed innermost first;
a tensor of more than 4 dims is stored reshaped, its own shape in the metadata field
`comfy.gguf.orig_shape.<name>`. Only the header is parsed here (the `gguf` package's reader); a tensor's bytes are
read with plain reads, dim-0 rows at a time, as folder.py reads safetensors: a block of rows is one byte range.

`read` returns a quantized tensor dequantized to float32; `qtype(name)` and `read_packed` give its blocks as
stored, which a quantized frozen base keeps (train/frozen_storage.py) and dequantizes per matmul. Keys keep the
file's names (the original checkpoint's layout, which single_file.py maps to diffusers' names).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vt.shared.errors import UserError
from vt.shared.weights.folder import TensorTable, block_of, narrowed, read_bytes
from vt.shared.weights.gguf_quants import BLOCK_SIZES, NAMES, dequantize

PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml type id -> torch dtype
ORIG_SHAPE = "comfy.gguf.orig_shape."


@dataclass(frozen=True)
class GgufEntry:
    file: Path
    dtype: torch.dtype  # what `read` returns: float32 for a quantized tensor
    shape: tuple[int, ...]  # the tensor's own shape (torch order)
    start: int
    end: int
    qtype: int | None  # the ggml block type, None for a plain tensor
    stored: tuple[int, ...]  # the shape it is stored in (torch order)


def _orig_shapes(reader) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith(ORIG_SHAPE):
            out[name[len(ORIG_SHAPE) :]] = tuple(int(field.parts[i][0]) for i in field.data)
    return out


class GgufWeights(TensorTable):
    """The tensors of one .gguf file, read on demand (`Weights`' interface: `in`, `names`, `shape`, `read`)."""

    def __init__(self, file: Path):
        try:
            from gguf import GGUFReader
        except ImportError as err:
            raise UserError(
                f"{file} is a GGUF file: reading it needs the gguf package (pip install 'vt[gguf]')"
            ) from err

        self.files = [Path(file)]
        reader = GGUFReader(file)
        shapes = _orig_shapes(reader)
        self.entries: dict[str, GgufEntry] = {}
        for tensor in reader.tensors:
            kind = int(tensor.tensor_type)
            if kind not in PLAIN and kind not in BLOCK_SIZES:
                raise UserError(
                    f"{file}: tensor {tensor.name} is ggml type {tensor.tensor_type.name}, which vt does not "
                    f"dequantize (it reads F32, F16, BF16, {', '.join(NAMES.values())}); convert the file "
                    "with one of those types"
                )
            stored = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            self.entries[tensor.name] = GgufEntry(
                Path(file),
                PLAIN.get(kind, torch.float32),
                shapes.get(tensor.name, stored),
                int(tensor.data_offset),
                int(tensor.data_offset) + int(tensor.n_bytes),
                None if kind in PLAIN else kind,
                stored,
            )
        del reader  # its map of the file

    def qtype(self, name: str) -> int | None:
        """The ggml block type `name` is stored in, None for a plain tensor."""
        return self.entries[name].qtype

    def read_packed(self, name: str, start: int = 0, rows: int | None = None) -> torch.Tensor:
        """Rows [start, start + rows) of a 2-D quantized tensor as stored: uint8 (rows, bytes per row)."""
        entry = self.entries[name]
        if entry.qtype is None or len(entry.shape) != 2 or entry.shape != entry.stored:
            raise ValueError(f"{name} is not a 2-D quantized tensor")
        rows = entry.shape[0] - start if rows is None else rows
        row_bytes = (entry.end - entry.start) // entry.shape[0]
        return read_bytes(entry, entry.start + start * row_bytes, rows * row_bytes).view(rows, row_bytes)

    def read(
        self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Tensor `name` (a quantized one dequantized to float32), or its block at `offsets` of `shape`."""
        entry = self.entries[name]
        full = entry.shape
        offsets, shape = block_of(name, full, offsets, shape)
        if full and entry.stored == full:  # dim-0 rows are byte ranges: read only the block's
            row_bytes = (entry.end - entry.start) // full[0]
            raw = read_bytes(entry, entry.start + offsets[0] * row_bytes, shape[0] * row_bytes)
            return narrowed(_decode(entry, raw, shape[0]).reshape(shape[0], *full[1:]), offsets, shape, first_dim=1)
        raw = read_bytes(entry, entry.start, entry.end - entry.start)  # a scalar, or stored reshaped
        return narrowed(_decode(entry, raw, 1).reshape(full), offsets, shape)


def _decode(entry: GgufEntry, raw: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows of `entry`'s bytes as values: viewed as stored, or dequantized to float32."""
    return raw.view(entry.dtype) if entry.qtype is None else dequantize(raw.view(rows, -1), entry.qtype)
