"""Block swap (`block_swap.blocks_on_gpu = K`): the first K blocks stay on the GPU, the others wait in host memory.

For one-GPU runs of models whose frozen weights do not fit beside the step (a 14B LoRA on a 24 GB card).

- Start-up: a swapped block's frozen parameters are made and filled in host memory (`materialize` with
  `host_blocks`, train/model_build.py), one page-locked arena per block (vt.shared.host_memory: exactly its bytes),
  quantized there when the base is quantized at read. Only what stays resident ever reaches the GPU, so the start-up
  peak is the steady one's weights, never the whole model.
- Steady state: just before a swapped block runs, forward or the recomputation in backward, its frozen weights are
  on the GPU, and the next block in running order (forward: the one after, backward: the one before) is already
  being copied on a side stream, so the copy overlaps this block's compute. After its forward the block's GPU copies
  are dropped (under activation checkpointing, required, nothing saves them), except the last block's: backward
  recomputes it first, so its copies stay (the first backward block is there without waiting). In backward a
  block's copies are dropped when the recomputation of the block before it starts (its gradients are done by then),
  and `release` drops the last ones after the step. Trainable parameters (adapters) and buffers stay on the GPU.
- Memory (`memory`, what `vt-train plan` counts): on the device, two swapped blocks' frozen weights at most (the
  one running and the one being copied); in host memory, every swapped block's arena.

On a CPU the copies are no copies (`.to` of a host tensor to the CPU is itself), so the tests run the same path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vt.shared.host_memory import layout_bytes
from vt.train.parallel.side_stream import SideStream


def frozen_parameters(block: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of `block` that block swap moves: the frozen ones (adapters train and stay)."""
    return {name: p for name, p in block.named_parameters() if not p.requires_grad}


def swapped_blocks(spec, model: nn.Module, resident: int) -> list[nn.Module]:
    """The blocks `block_swap.blocks_on_gpu = resident` keeps in host memory: all after the first `resident`."""
    return [block for _, block in spec.named_blocks(model)][resident:]


@dataclass(frozen=True)
class SwapMemory:
    frozen: int  # bytes of the swapped blocks' frozen weights (what leaves the device's resident weights)
    device: int  # bytes of them on the device at most: two blocks in flight (the one running, the next copied)
    host: int  # bytes of the swapped blocks' host arenas
    blocks: int  # how many blocks are swapped


def memory(spec, model: nn.Module, resident: int) -> SwapMemory:
    """What `block_swap.blocks_on_gpu = resident` costs for `model` (built on the meta device as the trainer builds
    it): each swapped block's frozen weights, and its arena as `materialize` lays it out."""
    blocks = [list(frozen_parameters(block).values()) for block in swapped_blocks(spec, model, resident)]
    sizes = [sum(p.numel() * p.element_size() for p in params) for params in blocks]
    arenas = [layout_bytes([(p.shape, p.dtype) for p in params]) for params in blocks]
    return SwapMemory(frozen=sum(sizes), device=sum(sorted(sizes)[-2:]), host=sum(arenas), blocks=len(blocks))


class BlockSwap:
    def __init__(self, blocks: list[nn.Module], resident: int, device: torch.device):
        """`blocks` in running order; the frozen weights of those after the first `resident` must be in host
        memory already (built there: `swapped_blocks` names them to `materialize`)."""
        self.device = device
        self.side = SideStream(device)
        # The module each block's forward runs (under activation checkpointing, the wrapped block: it also runs
        # in the recomputation).
        self.blocks = [getattr(block, "_checkpoint_wrapped_module", block) for block in blocks]
        self.swapped = set(range(resident, len(self.blocks)))
        self.last = max(self.swapped, default=-1)  # backward recomputes it first
        # Per swapped block: where each frozen parameter sits (module, attribute) and its host Parameter. A swap
        # puts a Parameter of the device copy in its place (frozen: no optimizer or gradient refers to it), and the
        # host one back after.
        self.slots: dict[int, dict[str, tuple[nn.Module, str]]] = {}
        self.host: dict[int, dict[str, nn.Parameter]] = {}
        self.loading: dict[int, tuple[dict[str, torch.Tensor], object | None]] = {}
        self.loads = 0  # copies to the device (tests and logs)
        for index in sorted(self.swapped):
            slots = {
                f"{path}.{attr}" if path else attr: (module, attr)
                for path, module in self.blocks[index].named_modules()
                for attr, p in module._parameters.items()
                if p is not None and not p.requires_grad
            }
            on_device = [
                name for name, (module, attr) in slots.items() if module._parameters[attr].device.type != "cpu"
            ]
            if on_device:
                raise RuntimeError(
                    f"block {index}'s frozen weights ({on_device[0]} ...) are on {device}: a swapped "
                    "block is built in host memory (model_build.materialize, host_blocks) (internal "
                    "error)"
                )
            self.slots[index] = slots
            self.host[index] = {name: module._parameters[attr] for name, (module, attr) in slots.items()}
        for index, block in enumerate(self.blocks):  # every block: a resident one starts the first swapped one's copy
            block.register_forward_pre_hook(lambda module, args, index=index: self._before(index))
            block.register_forward_hook(lambda module, args, out, index=index: self._after(index))

    def _put(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, (module, attr) in self.slots[index].items():
            tensor = tensors[name]
            module._parameters[attr] = (
                tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
            )

    def _point_at_host(self, index: int) -> None:
        self._put(index, self.host[index])

    def _in_use(self, index: int) -> dict[str, torch.Tensor]:
        return {name: module._parameters[attr].data for name, (module, attr) in self.slots[index].items()}

    def _fetch(self, index: int) -> None:
        """Start copying block `index`'s frozen weights to the device (on the side stream)."""
        if index not in self.swapped or index in self.loading:
            return
        self.loads += 1
        host = self.host[index]
        self.loading[index] = self.side.start(
            lambda: {name: t.data.to(self.device, non_blocking=True) for name, t in host.items()}
        )

    def _before(self, index: int) -> None:
        backward = torch._C._current_graph_task_id() != -1  # the recomputation inside backward
        if backward and index + 1 in self.swapped:
            self._point_at_host(index + 1)  # its gradients are done: backward runs the blocks in reverse
        if index in self.swapped:
            self._fetch(index)
            copies, done = self.loading.pop(index)
            self.side.wait(done, list(copies.values()))
            self._put(index, copies)
        self._fetch(index - 1 if backward else index + 1)  # the next block in running order, while this one runs

    def _after(self, index: int) -> None:
        """After a block's forward: its copies go (in backward its recomputed graph still needs them), but for the
        last block's in a training forward, which backward recomputes first."""
        if index not in self.swapped or torch._C._current_graph_task_id() != -1:
            return
        if index == self.last and torch.is_grad_enabled():
            self.loading[index] = (self._in_use(index), None)
        self._point_at_host(index)

    def release(self) -> None:
        """After a step's backward: every swapped block back on its host copy, no copy in flight."""
        for index in self.swapped:
            self._point_at_host(index)
        self.loading.clear()

    def on_device_bytes(self) -> int:
        """Bytes of the swapped blocks' frozen weights held on the device right now (in flight included)."""
        return sum(
            t.numel() * t.element_size()
            for copies, _ in self.loading.values()
            for t in copies.values()
            if t.device.type != "cpu" or self.device.type == "cpu"
        )
