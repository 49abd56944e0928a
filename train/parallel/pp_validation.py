"""Inference through pipeline stages: every forward of a stage-split transformer runs as one pass over the stages.

A diffusers pipeline calls `transformer(...)` once (or once per guidance branch, or per sample) per
denoising step; under parallel.pp > 1 each rank's transformer holds only its stage's blocks, the others'
being relays (pp.py). While `staged_inference(...)` is active, on every pp rank of a group, every such
call runs as:

- stage 0 runs the forward as it is: the parts before the blocks, its own blocks (the last one's output
  is kept by `keep_last_output`'s hook), and sends that output to stage 1;
- stage k receives it before its forward (a forward pre-hook puts it where the relays before its first
  block hand it on), runs its own blocks and sends theirs on;
- the last stage's forward ends with the real output (the parts after the blocks), which is broadcast
  over the pp group into every stage's output (each stage's forward returned one of the same structure
  and shapes: its relays carried its own hidden state to the end).

So every rank's pipeline gets the same prediction, takes the same scheduler step and keeps the same
latents, and the calls stay in step on all stages. No autograd, no pipelining schedule: plain send,
receive and broadcast over the pp group, block by block as the pipeline asks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from vt.train.parallel.pp import PipelineSplit, pipeline_split


def _tensors(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple) else [value]


class _StagedForward:
    """The hooks that make one stage-split transformer's forward a pass over all stages."""

    def __init__(self, split: PipelineSplit, device: torch.device):
        self.split, self.device = split, device

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.split.group, stage)

    def before(self, module, args, kwargs):
        split = self.split
        if split.is_first:
            split.baton.value = None
            return None
        shapes = [None]
        dist.recv_object_list(shapes, src=self._peer(split.stage - 1), group=split.group, device=torch.device("cpu"))
        received = []
        for shape, dtype in shapes[0]:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(tensor, src=self._peer(split.stage - 1), group=split.group)
            received.append(tensor)
        split.baton.value = received[0] if len(received) == 1 else tuple(received)
        return None

    def after(self, module, args, output):
        split = self.split
        try:
            if not split.is_last:
                if split.baton.value is None:
                    raise RuntimeError(f"pipeline stage {split.stage} ran no block of its own during inference")
                sent = [t.contiguous() for t in _tensors(split.baton.value)]
                dist.send_object_list(
                    [[(tuple(t.shape), t.dtype) for t in sent]],
                    dst=self._peer(split.stage + 1),
                    group=split.group,
                    device=torch.device("cpu"),
                )
                for tensor in sent:
                    dist.send(tensor, dst=self._peer(split.stage + 1), group=split.group)
        finally:
            split.baton.value = None
        leaves, spec = pytree.tree_flatten(output)
        shared = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                leaf = (
                    leaf.contiguous()
                    if split.is_last
                    else torch.empty_like(leaf, memory_format=torch.contiguous_format)
                )
                dist.broadcast(leaf, src=self._peer(split.stages - 1), group=split.group)
            shared.append(leaf)
        return pytree.tree_unflatten(shared, spec)


@contextmanager
def staged_inference(models: list[nn.Module], device: torch.device):
    """While active, every forward of each stage-split model in `models` runs over all pipeline stages and
    returns the last stage's output on every stage; models without a split are left as they are. Every pp
    rank must make the same forward calls in the same order (the same pipeline on the same inputs)."""
    handles = []
    try:
        for model in models:
            split = pipeline_split(model)
            if split is None:
                continue
            staged = _StagedForward(split, device)
            handles.append(model.register_forward_pre_hook(staged.before, with_kwargs=True))
            handles.append(model.register_forward_hook(staged.after))
        yield
    finally:
        for handle in handles:
            handle.remove()
