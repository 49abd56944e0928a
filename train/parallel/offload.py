"""Activation offload (`parallel.activation_offload`): the checkpointed blocks' inputs wait in host memory.

With activation checkpointing, what a training step keeps on the device between its forward and its
backward is each block's input (torch's checkpoint saves it through the saved-tensor hooks in effect, and
recomputes the block from it in backward) plus what the layers outside the blocks save. Under
`OffloadSaved`, those saved tensors go to (pinned) host memory as they are saved and come back when
backward unpacks them for the block's recomputation:

- on CUDA the copy out runs on a side stream after the compute stream has produced the tensor (the
  tensor's memory is released to the allocator once that copy is done: `record_stream`), so it overlaps
  the next block's forward; the copy back is enqueued on the compute stream when backward reaches the
  block (not yet fetched a block ahead);
- on a CPU the same path copies into host memory (no memory is saved there; the tests run it for parity);
- parameters (and views of them) stay where they are: they are not activations, and FSDP2 frees its
  gathered copies itself; tensors under `min_bytes` stay too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class OffloadSaved:
    """Saved-tensor hooks that keep activations in host memory between forward and backward."""

    def __init__(self, device: torch.device, min_bytes: int | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.min_bytes = (2**20 if self.cuda else 0) if min_bytes is None else min_bytes
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.offloaded = 0  # tensors sent to host memory (tests and logs)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def _keeps(self, tensor: torch.Tensor) -> bool:
        base = tensor._base if tensor._base is not None else tensor
        return (isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter) or tensor.device.type == "meta"
                or tensor.numel() * tensor.element_size() < self.min_bytes)

    def pack(self, tensor: torch.Tensor):
        if self._keeps(tensor):
            return tensor
        self.offloaded += 1
        if not self.cuda:
            return ("host", tensor.device, tensor.detach().clone())
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # its memory returns to the allocator once the copy is done
            done = torch.cuda.Event()
            done.record(self.stream)
        return ("host", tensor.device, host, done)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        _, device, host, *done = packed
        if done:
            torch.cuda.current_stream(device).wait_event(done[0])
        return host.to(device, non_blocking=self.cuda)
