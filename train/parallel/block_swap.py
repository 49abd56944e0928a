"""Block swap (`parallel.blocks_on_gpu = K`): the first K blocks stay on the GPU, the others wait in host memory.

For one-GPU runs of models whose frozen weights do not fit beside the step (a 14B LoRA on a 24 GB card). A
swapped block's frozen parameters live in pinned host memory; just before the block runs, forward or the
recomputation in backward, they are on the GPU, and the next block in running order (forward: the one
after, backward: the one before) is already being copied on a side stream, so the copy overlaps this
block's compute. After its forward the block's GPU copies are dropped: under activation checkpointing
(required) nothing saves them, so their memory goes back at once. In backward a block's copies are dropped
when the recomputation of the block before it starts (its own gradients are done by then: backward runs the
blocks in reverse), and `release` drops the last ones after the step. Trainable parameters (LoRA adapters)
stay on the GPU, as do buffers. On a CPU the "GPU copies" are copies in host memory, so the tests run the
same path.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockSwap:
    def __init__(self, blocks: list[nn.Module], resident: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # The module each block's forward runs (under activation checkpointing, the wrapped block: it also runs
        # in the recomputation).
        self.blocks = [getattr(block, "_checkpoint_wrapped_module", block) for block in blocks]
        self.swapped = set(range(resident, len(self.blocks)))
        self.host: dict[int, dict[str, torch.Tensor]] = {}
        self.loading: dict[int, tuple[dict[str, torch.Tensor], torch.cuda.Event | None]] = {}
        self.loads = 0  # copies to the GPU (tests and logs)
        for index in sorted(self.swapped):
            frozen = {name: p for name, p in self.blocks[index].named_parameters() if not p.requires_grad}
            self.host[index] = {name: self._to_host(p.detach()) for name, p in frozen.items()}
            self._point_at_host(index)
        for index, block in enumerate(self.blocks):  # every block: a resident one starts the first swapped one's copy
            block.register_forward_pre_hook(lambda module, args, index=index: self._before(index))
            block.register_forward_hook(lambda module, args, out, index=index: self._after(index))
        if self.cuda:
            torch.cuda.empty_cache()

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.cuda)
        host.copy_(tensor)
        return host

    def _params(self, index: int) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.blocks[index].named_parameters() if name in self.host[index]}

    def _point_at_host(self, index: int) -> None:
        for name, param in self._params(index).items():
            param.data = self.host[index][name]

    def _fetch(self, index: int) -> None:
        """Start copying block `index`'s frozen weights to the device (side stream on CUDA)."""
        if index not in self.swapped or index in self.loading:
            return
        self.loads += 1
        if not self.cuda:
            self.loading[index] = ({name: t.clone() for name, t in self.host[index].items()}, None)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies = {name: t.to(self.device, non_blocking=True) for name, t in self.host[index].items()}
            done = torch.cuda.Event()
            done.record(self.stream)
        self.loading[index] = (copies, done)

    def _before(self, index: int) -> None:
        backward = torch._C._current_graph_task_id() != -1  # the recomputation inside backward
        if backward and index + 1 in self.swapped:
            self._point_at_host(index + 1)  # its gradients are done: backward runs the blocks in reverse
        if index in self.swapped:
            self._fetch(index)
            copies, done = self.loading.pop(index)
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
                for tensor in copies.values():
                    tensor.record_stream(torch.cuda.current_stream(self.device))
            for name, param in self._params(index).items():
                param.data = copies[name]
        self._fetch(index - 1 if backward else index + 1)  # the next block in running order, while this one runs

    def _after(self, index: int) -> None:
        """After a block's forward: its copies go (in backward its recomputed graph still needs them)."""
        if index in self.swapped and torch._C._current_graph_task_id() == -1:
            self._point_at_host(index)

    def release(self) -> None:
        """After a step's backward: every swapped block back on its host copy, no copy in flight."""
        for index in self.swapped:
            self._point_at_host(index)
        self.loading.clear()

    def on_device_bytes(self) -> int:
        """Bytes of the swapped blocks' frozen weights held on the device right now (in flight included)."""
        return sum(t.numel() * t.element_size() for copies, _ in self.loading.values() for t in copies.values())
