"""Activation offload (`activation_offload.enabled`): the checkpointed blocks' inputs wait in host memory.

With activation checkpointing, what a training step keeps on the device between its forward and its backward is
each block's input (torch's checkpoint saves it through the saved-tensor hooks in effect, and recomputes the block
from it in backward) plus what the layers outside the blocks save. Under `OffloadSaved`, those saved tensors go to
host memory as they are saved and come back when backward unpacks them for the block's recomputation:

- Host memory is one arena (vt.shared.host_memory.Arena: page-locked on CUDA, exactly the bytes, never torch's
  power-of-two pinned blocks), taken from in saving order and given back whole after each backward (`done`): it
  grows to the most one micro-step saves, then stays.
- Out: each copy runs on a side stream once the compute stream has made the tensor (its device memory returns to
  the allocator when that copy is done), overlapping the next block's forward.
- Back: when backward unpacks a block's input, the input saved before it (the next recomputation's) starts its
  copy back on the side stream, so it overlaps this block's recomputation and backward; the last one saved starts
  when the forward ends. At most one input is on its way back at a time beside the one in use.
- Kept where they are: parameters (and views of them; FSDP2 frees its gathered copies itself), tensors not on the
  device (a host tensor is never copied or stream-recorded), tensors under `min_bytes`, and a tensor saved again
  while its first saving is pending (one host copy; when it is unpacked while the original still lives, e.g. the
  text embeddings every block reads, the original is used and nothing is copied back).

On a CPU the same path copies into host memory (no memory is saved there; the tests run it for parity).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from vt.shared.host_memory import Arena
from vt.train.parallel.side_stream import SideStream


@dataclass
class _Saved:
    """One saved tensor in host memory: its copy out, and once asked for, its copy back."""

    original: weakref.ref
    version: int  # the original's version when saved: an in-place change since makes it another value
    host: torch.Tensor
    out: object | None  # the copy out's event (None: done)
    back: tuple[torch.Tensor, object | None] | None = None  # the copy back and its event, once started
    users: int = 1  # savings of this tensor not unpacked yet
    unpacked: bool = False


class OffloadSaved:
    """Saved-tensor hooks that keep activations in host memory between forward and backward."""

    def __init__(self, device: torch.device, min_bytes: int | None = None):
        self.device = device
        self.min_bytes = (2**20 if device.type != "cpu" else 0) if min_bytes is None else min_bytes
        self.side = SideStream(device)
        self.arena = Arena(device)
        self.saved: list[_Saved] = []  # this micro-step's, in saving order
        self.offloaded = 0  # tensors sent to host memory (tests and logs)
        self.fetched_ahead = 0  # copies back started before their unpack (tests and logs)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield
        self._fetch_before(len(self.saved))  # backward unpacks the last one first

    def _keeps(self, tensor: torch.Tensor) -> bool:
        base = tensor._base if tensor._base is not None else tensor
        return (
            isinstance(tensor, nn.Parameter)
            or isinstance(base, nn.Parameter)
            or tensor.device != self.device
            or tensor.numel() * tensor.element_size() < self.min_bytes
        )

    def pack(self, tensor: torch.Tensor):
        if self._keeps(tensor):
            return tensor
        for saved in reversed(self.saved):  # saved again (a block's shared input): one host copy
            if saved.original() is tensor and saved.version == tensor._version and not saved.unpacked:
                saved.users += 1
                return saved
        self.offloaded += 1
        host = self.arena.take(tensor.shape, tensor.dtype)
        _, out = self.side.start(lambda: host.copy_(tensor, non_blocking=True))
        self.side.free_after_copy(tensor)
        saved = _Saved(weakref.ref(tensor), tensor._version, host, out)
        self.saved.append(saved)
        return saved

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        saved: _Saved = packed
        saved.users -= 1
        saved.unpacked = saved.users == 0
        if _alive(saved):  # the original lives on elsewhere, unchanged: nothing to copy back
            return saved.original()
        if saved.back is None:
            self._fetch(saved)
        else:
            self.fetched_ahead += 1
        tensor, done = saved.back
        if saved.unpacked:
            saved.back = None
        self.side.wait(done, [tensor])
        self._fetch_before(self.saved.index(saved))
        return tensor

    def _fetch(self, saved: _Saved) -> None:
        """Start copying `saved` back to the device (on the side stream, after its copy out there)."""
        saved.back = self.side.start(lambda: saved.host.to(self.device, non_blocking=True))

    def _fetch_before(self, index: int) -> None:
        """Start the copy back of the nearest tensor saved before position `index` that backward will want next."""
        for saved in reversed(self.saved[:index]):
            if saved.unpacked or _alive(saved):
                continue
            if saved.back is None:
                self._fetch(saved)
            return

    def done(self) -> None:
        """After a micro-step's backward: every saved tensor was unpacked; the arena is free for the next one."""
        self.saved = []
        self.arena.reset()

    def host_bytes(self) -> int:
        """Host memory this offload holds (its arena)."""
        return self.arena.bytes_held()


def _alive(saved: _Saved) -> bool:
    original = saved.original()
    return original is not None and original._version == saved.version
