"""A component's safetensors weights, read one tensor (or one block of rows) at a time into its destination.

safetensors' own reader maps the whole file: the pages a process touches stay in its resident set
until the file is closed, so reading a model tensor by tensor holds the file's pages *and* the
copies (about 2x the weights at the peak). `Weights` parses the header itself (8 bytes of length,
then JSON: each tensor's dtype, shape and byte range) and reads a tensor's bytes with plain reads
into a buffer of its own, so a process holds the tensors it keeps and one tensor in flight.

`read(name, offsets, shape)` returns the block of a tensor that starts at `offsets` (one per dim)
with `shape`: the rows of a dim-0 shard (FSDP2, column-wise TP) are one contiguous byte range and
are all that is read; a shard along a later dim (row-wise TP) reads its rows and keeps its columns.
A sharded checkpoint (`*.safetensors.index.json`) is one `Weights` over its files. A single file in the
original checkpoint's layout, fp8-scaled too, is read through the same interface by single_file.py.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from vt.shared.errors import UserError

# safetensors dtype names -> torch dtypes (https://github.com/huggingface/safetensors, format section)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the tensor's data in `file`
    end: int


def read_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors of one .safetensors file (name -> Entry) and its metadata."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise UserError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which vt cannot read")
        begin, end = info["data_offsets"]
        entries[name] = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, base + end)
    return entries, metadata


def block_of(name: str, full: tuple[int, ...], offsets, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of a block of tensor `name` (of shape `full`): the whole tensor where they are None; a
    block outside it is a ValueError."""
    offsets = tuple(offsets) if offsets is not None else (0,) * len(full)
    shape = tuple(shape) if shape is not None else full
    if (
        len(offsets) != len(full)
        or len(shape) != len(full)
        or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, shape, full))
    ):
        raise ValueError(f"block at {offsets} of shape {shape} is outside {name} {full}")
    return offsets, shape


def narrowed(
    tensor: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], first_dim: int = 0
) -> torch.Tensor:
    """The block at `offsets` of `shape` of `tensor` along its dims from `first_dim` on, contiguous."""
    for dim in range(first_dim, tensor.ndim):
        if (offsets[dim], shape[dim]) != (0, tensor.shape[dim]):
            tensor = tensor.narrow(dim, offsets[dim], shape[dim])
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class TensorTable:
    """The lookups of the reading interface over `entries` (name -> an entry with `shape`): `in`, `names`, `shape`."""

    entries: dict

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape


class Weights(TensorTable):
    """The tensors of a component folder's safetensors files, read on demand."""

    def __init__(self, files: list[Path]):
        if not files:
            raise FileNotFoundError("no .safetensors files given")
        self.files = [Path(f) for f in files]
        self.entries: dict[str, Entry] = {}
        for file in self.files:
            entries, _ = read_header(file)
            self.entries.update(entries)

    @classmethod
    def in_folder(cls, folder: Path) -> "Weights":
        """The weights of a diffusers/transformers component folder: the files its index names, else every
        .safetensors file in it. FileNotFoundError if it holds none."""
        folder = Path(folder)
        indexes = sorted(folder.glob("*.safetensors.index.json"))
        if indexes:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
        else:
            files = sorted(p for p in folder.glob("*.safetensors") if "." not in p.stem)  # no variants (.fp16)
            files = files or sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no .safetensors weights")
        return cls(files)

    def scaled_modules(self) -> set[str]:
        """Modules whose weight is stored with a per-tensor scale: none in a diffusers-layout folder (a single
        fp8-scaled file has them: single_file.py)."""
        return set()

    def scale(self, name: str) -> None:
        return None

    def quantized_modules(self) -> dict:
        """Modules whose weight is stored in quantized blocks: none in safetensors (a GGUF file has them)."""
        return {}

    def read(
        self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Tensor `name` in its stored dtype on the CPU, or its block at `offsets` of `shape`."""
        entry = self.entries[name]
        full = entry.shape
        offsets, shape = block_of(name, full, offsets, shape)
        if not full:  # a scalar
            return self._read_bytes(entry, entry.start, entry.end - entry.start).view(entry.dtype).reshape(())
        row_bytes = (entry.end - entry.start) // max(full[0], 1)
        rows = self._read_bytes(entry, entry.start + offsets[0] * row_bytes, shape[0] * row_bytes)
        return narrowed(rows.view(entry.dtype).reshape(shape[0], *full[1:]), offsets, shape, first_dim=1)

    @staticmethod
    def _read_bytes(entry, start: int, count: int) -> torch.Tensor:
        return read_bytes(entry, start, count)


def read_bytes(entry, start: int, count: int) -> torch.Tensor:
    """`count` bytes of `entry.file` from `start`, with plain reads into a buffer of their own."""
    buffer = torch.empty(count, dtype=torch.uint8)
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(start)
        view, done = memoryview(buffer.numpy()), 0
        while done < count:
            got = f.readinto(view[done:])
            if not got:
                raise OSError(f"{entry.file} ends before the bytes its header names (truncated file?)")
            done += got
    return buffer
