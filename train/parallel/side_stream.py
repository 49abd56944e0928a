"""Copies between host and device that overlap compute: on CUDA they run on a stream of their own and the compute
stream waits for them only where it uses their result; on any other device they run in order, as written.

Block swap (block_swap.py) and activation offload (offload.py) move tensors this way. The code around them is the
same on every device; only `start` and `wait` differ, so a CPU test (or a byte-counting stand-in for the GPU) runs
the very path a GPU runs, streams aside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class SideStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, copy: Callable[[], T]) -> tuple[T, object | None]:
        """Run `copy` (which enqueues copies) after what the compute stream has enqueued so far, on the side stream;
        returns its result and the event to `wait` for (None off CUDA: done already)."""
        if self.stream is None:
            return copy(), None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = copy()
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def wait(self, done: object | None, used: list[torch.Tensor] = ()) -> None:
        """The compute stream waits for `done`; the device tensors in `used`, made on the side stream and used on the
        compute stream, go back to the allocator only after the compute stream's use (`record_stream`, which exists
        for device memory only: a host tensor is never passed to it)."""
        if done is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for tensor in used:
            if tensor.device.type == "cuda":
                tensor.record_stream(current)

    def free_after_copy(self, tensor: torch.Tensor) -> None:
        """A device `tensor` copied out on the side stream: its memory returns to the allocator once that copy is
        done, not when the compute stream drops it."""
        if self.stream is not None and tensor.device.type == "cuda":
            tensor.record_stream(self.stream)
