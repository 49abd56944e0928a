"""Full weights of a stage-split transformer, streamed to the one writer tensor by tensor in the one-process order.

Each stage holds the parts outside the blocks and its own blocks (pp.py). The export's file layout is the
one-process model's: its tensors in `state_dict` order, which is the module tree's pre-order (a module's own
parameters and buffers, then its children's). Every stage still holds the whole tree down to each block (a
relay stands where another stage's block is), so a tensor's place in that order is (the position of its module,
or of its block, in the tree with every block folded into one node; its place among that module's tensors):
the same on every stage. The stages exchange their tensors' names, shapes and dtypes (no data), and each tensor
then goes, one at a time, from its stage to the writer (global rank 0): no rank ever holds more than one whole
tensor of another stage, nor the whole model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vt.train.parallel.pp import PipelineSplit, Relay

Entry = tuple[str, tuple[int, ...], torch.dtype, int]  # name, shape, dtype written, bytes


def _folded_positions(model: nn.Module, split: PipelineSplit) -> dict[str, int]:
    """Module name -> its position in the pre-order of `model`'s tree, every block (own or relay) one node."""
    blocks = {name for name, module in model.named_modules() if isinstance(module, Relay) or name in split.owned}
    positions: dict[str, int] = {}
    for name, _ in model.named_modules():
        if not any(name.startswith(block + ".") for block in blocks):
            positions[name] = len(positions)
    return positions


def _position(name: str, positions: dict[str, int]) -> int:
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:cut])
        if owner in positions:
            return positions[owner]
    raise KeyError(f"no module of the transformer holds {name}")


class StageStream:
    """The stages' tensors as one model's: `entries` in the one-process order, and `fetch(name)`, which every
    rank calls for every entry in that order (a collective): the tensor's bytes on the writer, None elsewhere."""

    def __init__(
        self,
        model: nn.Module,
        state: dict[str, torch.Tensor],
        split: PipelineSplit,
        dtype_of: Callable[[str, torch.Tensor], torch.dtype],
    ):
        self.state, self.split = state, split
        positions = _folded_positions(model, split)
        local = []
        for index, (name, tensor) in enumerate(state.items()):
            dtype = dtype_of(name, tensor) if tensor.is_floating_point() else tensor.dtype
            size = tensor.numel() * torch.empty((), dtype=dtype).element_size()
            local.append(((_position(name, positions), index), name, tuple(tensor.shape), dtype, size))
        stages = [None] * split.stages
        dist.all_gather_object(stages, local, group=split.group)  # names, shapes, dtypes: no data
        owner: dict[str, int] = {}
        merged = []
        for stage, listed in enumerate(stages):
            for key, name, shape, dtype, size in listed:
                if name not in owner:  # the parts outside the blocks: every stage lists them, the first sends
                    owner[name] = stage
                    merged.append((key, name, shape, dtype, size))
        self.owner = owner
        self.entries: list[Entry] = [entry[1:] for entry in sorted(merged, key=lambda entry: entry[0])]
        self.dtypes = {name: dtype for name, _, dtype, _ in self.entries}
        self.sizes = {name: size for name, _, _, size in self.entries}
        self.writes = dist.get_rank() == 0
        self.on_writers_path = dist.get_global_rank(split.group, 0) == 0  # this pp group's stages feed the writer

    def fetch(self, name: str) -> torch.Tensor | None:
        stage = self.owner[name]
        data = None
        if stage == self.split.stage:
            tensor = self.state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # a collective within the stage
            data = full.detach().to("cpu", self.dtypes[name]).contiguous().reshape(-1).view(torch.uint8)
            del full
        if not self.on_writers_path or stage == 0:
            return data if self.writes else None
        source = dist.get_global_rank(self.split.group, stage)
        if self.writes:
            size = self.sizes[name]
            data = torch.empty(size, dtype=torch.uint8)
            if size:
                dist.recv(data, src=source, group=self.split.group)
            return data
        if self.split.stage == stage and data.numel():
            dist.send(data, dst=0, group=self.split.group)
        return None
