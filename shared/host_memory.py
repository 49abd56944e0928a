"""Host memory for what a GPU run keeps off the GPU: exactly the bytes asked for, page-locked where the device is CUDA.

torch's own pinned tensors (`pin_memory=True`, `Tensor.pin_memory()`) come from its caching host allocator, which
rounds every block up to a power of two: one Wan 2.1 14B block's 0.68 GiB of frozen weights takes 1 GiB, and a
step's offloaded activations pinned one by one up to twice their bytes. vt never pins tensor by tensor. It takes a
plain host allocation of exactly the bytes (glibc maps large ones: no heap rounding either) and page-locks that with
the driver (`cudaHostRegister`), one allocation per arena: a swapped block's frozen weights, the step's offloaded
activations. Tensors are views into an arena; a copy from one to the GPU with `non_blocking=True` is asynchronous,
as from any pinned memory.

- `HostBuffer(nbytes, device)`: one arena of bytes, page-locked when `pins(device)` (at once, or once filled:
  `lock_later`, then `lock()`) and unlocked when the buffer object goes (its owner keeps it as long as any view of
  it is in use).
- `views(buffer, tensors)`: tensors of the given shapes and dtypes laid out in one buffer (each aligned).
- `Arena`: a bump allocator over a buffer that grows to the most one round (a training step) took, then stays.

`pinned_bytes()` says how many bytes this process has page-locked this way (the run's host figure, logged and
tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ALIGN = 512  # bytes: every view starts on a multiple (what CUDA copies like, and any dtype's alignment)
_pinned = 0  # bytes page-locked through HostBuffer in this process


def pins(device: torch.device) -> bool:
    """Whether host copies for `device` are page-locked (CUDA: asynchronous copies need it)."""
    return device.type == "cuda"


def pinned_bytes() -> int:
    return _pinned


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class HostBuffer:
    """`nbytes` of host memory (uint8, `.bytes`), page-locked with the driver when `pins(device)`: at once, or with
    `lock_later` when `lock()` is called (page-locking commits every page, so a buffer filled from tensors that are
    freed as they are copied, and locked once full, never holds both at once)."""

    def __init__(self, size: int, device: torch.device, lock_later: bool = False):
        self.bytes = torch.empty(size, dtype=torch.uint8)
        self.device = device
        self.pinned = False
        if not lock_later:
            self.lock()

    def lock(self) -> None:
        """Page-lock the bytes (if `pins(device)`; once)."""
        global _pinned
        if pins(self.device) and self.size > 0 and not self.pinned:
            _register(self.bytes)
            _pinned += self.size
            self.pinned = True

    @property
    def size(self) -> int:
        return self.bytes.numel()

    def unpin(self) -> None:
        """Unlock the pages (before the memory is freed: freed memory must not stay registered)."""
        global _pinned
        if self.pinned:
            _unregister(self.bytes)
            _pinned -= self.size
            self.pinned = False

    def __del__(self) -> None:  # the buffer's bytes (and so its memory) outlive this call
        self.unpin()


def views(buffer: torch.Tensor, shapes: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """Tensors of `shapes` ((shape, dtype) each) laid out one after another in the uint8 `buffer`, each aligned."""
    out, offset = [], 0
    for shape, dtype in shapes:
        size = nbytes(shape, dtype)
        out.append(buffer[offset : offset + size].view(dtype).view(tuple(shape)))
        offset += aligned(size)
    return out


def layout_bytes(shapes: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """The bytes `views` lays `shapes` out in."""
    return sum(aligned(nbytes(shape, dtype)) for shape, dtype in shapes)


class Arena:
    """Host tensors taken one after another from one buffer and all given back at once (`reset`, once a round of
    use, a training step, is over). A round that needs more than the buffer takes the rest as buffers of their own;
    the next reset replaces them all by one buffer of the round's total, so from then on one buffer serves (the
    largest round sets its size, as the plan counts it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: HostBuffer | None = None
        self.extra: list[HostBuffer] = []
        self.used = 0  # bytes taken from `buffer` this round
        self.round_bytes = 0  # bytes taken this round, from the buffer and the extra ones
        self.peak = 0  # the most one round took
        self.grow_to = 0  # the size of the buffer the next round starts (after a round that needed more)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        size = aligned(nbytes(shape, dtype))
        self.round_bytes += size
        self.peak = max(self.peak, self.round_bytes)
        if self.buffer is None and self.grow_to:  # (made at the round's first take: the last round's are gone)
            self.buffer, self.grow_to = HostBuffer(self.grow_to, self.device), 0
        if self.buffer is not None and self.used + size <= self.buffer.size:
            view = views(self.buffer.bytes[self.used :], [(shape, dtype)])[0]
            self.used += size
            return view
        extra = HostBuffer(size, self.device)
        self.extra.append(extra)
        return views(extra.bytes, [(shape, dtype)])[0]

    def reset(self) -> None:
        """Every tensor taken is given back (the caller holds none of them any more)."""
        if self.extra:
            for extra in [*self.extra, self.buffer]:
                if extra is not None:
                    extra.unpin()
            self.extra, self.buffer, self.grow_to = [], None, self.peak
        self.used = self.round_bytes = 0

    def bytes_held(self) -> int:
        return (self.buffer.size if self.buffer is not None else 0) + sum(extra.size for extra in self.extra)

    def close(self) -> None:
        for held in [self.buffer, *self.extra]:
            if held is not None:
                held.unpin()
        self.buffer, self.extra = None, []


def _register(tensor: torch.Tensor) -> None:
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(error) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {tensor.numel() / 2**30:.2f} GiB failed (error {int(error)}): the "
            "host may limit locked memory (ulimit -l), or have too little free"
        )


def _unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
