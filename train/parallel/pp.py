"""Pipeline parallel: the transformer's blocks split into `pp` stages, run by torch.distributed.pipelining.

Each stage keeps the whole transformer except the blocks other stages own (`spec.named_blocks`, split
into contiguous runs of nearly equal length); each of those is replaced by a `Relay`, a module without
parameters that returns the hidden state handed over by the pipeline. Every stage then runs the family's
own `spec.forward` unchanged:

- the parts before and after the blocks (patch embedding, text and time embedders, output norm and
  projection) run on every stage: they are cheap next to the blocks, and recomputing them spares
  rewriting each family's forward into stage pieces;
- on a receiving stage the relays before its first block return the activation received from the
  previous stage, so its own blocks continue the previous stage's computation;
- on a sending stage a forward hook on its last block keeps that block's output (a tensor, or the
  tuple a joint block returns), which is what the stage sends; the relays after it return it too, so
  the forward runs to its end, and the loss computed there from it is thrown away;
- the last stage returns the microbatch's scaled loss, which the schedule backpropagates.

`torch.distributed.pipelining`'s `PipelineStage` carries the activations and their gradients between
stages and its `ScheduleGPipe` / `Schedule1F1B` order the microbatches. A microbatch is one sample of
the rank's data-parallel slice (a stand-in of weight 0 pads the last, smaller, step), so every
microbatch of a bucket has the same shapes; a stage and schedule are built per bucket, because
pipelining infers the shapes it sends from the first step it runs (a real forward and backward).

Parameters outside the blocks are replicated over the stages, each of which sees only part of their
gradient (a stage's own blocks' use of the text embedding, say): after the backward their gradients are
summed over the pp ranks, so every stage steps them identically. The block parameters exist on one stage
each, so the global gradient norm sums their squares over the stages. A checkpoint holds each
parameter once under its own name (DCP deduplicates the replicated ones), so it resumes without PP or
with another split.

Inference (validation) runs each transformer call over the stages with plain sends instead of a schedule
(pp_validation.py); a full-weight export streams each stage's tensors to the writer (pp_export.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vt.shared.errors import UserError
from vt.train.parallel.batching import Slice


class _Baton:
    """The hidden state between blocks of a stage: received from the previous stage, or kept from the
    stage's own last block."""

    value = None


class Relay(nn.Module):
    """In place of a block another stage owns: returns the hidden state the pipeline hands over."""

    pipeline_relay = True  # spec.named_blocks skips it, so no layout (TP, FSDP2, checkpointing) wraps it

    def __init__(self, baton: _Baton, name: str):
        super().__init__()
        self._baton = baton
        self.owner_name = name

    def forward(self, *args, **kwargs):
        if self._baton.value is None:
            raise RuntimeError(f"pipeline relay for {self.owner_name} ran without a hidden state")
        return self._baton.value


def stage_bounds(blocks: int, stage: int, stages: int) -> tuple[int, int]:
    """[first, stop) of the blocks stage `stage` of `stages` owns: contiguous, sizes differ by at most one."""
    if blocks < stages:
        raise UserError(f"parallel.pp = {stages} stages but the transformer has {blocks} blocks; lower parallel.pp")
    base, extra = divmod(blocks, stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (stage < extra)


class PipelineSplit:
    """Which blocks this stage owns; set on the transformer by `split_blocks` (`transformer._vt_pipeline`)."""

    def __init__(self, stage: int, stages: int, owned: list[str], group=None):
        self.stage, self.stages, self.owned = stage, stages, owned
        self.group = group  # the process group of this rank's pp peers (the same other coordinates)
        self.baton = _Baton()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def owns(self, name: str) -> bool:
        """Whether parameter `name` belongs to one of this stage's blocks (not replicated over stages)."""
        return any(name.startswith(block + ".") for block in self.owned)


def split_blocks(model: nn.Module, spec, stage: int, stages: int, group=None) -> PipelineSplit:
    """Replace the blocks stage `stage` does not own by relays (before any other layout is applied)."""
    named = spec.named_blocks(model)
    first, stop = stage_bounds(len(named), stage, stages)
    split = PipelineSplit(stage, stages, [name for name, _ in named[first:stop]], group)
    for index, (name, _) in enumerate(named):
        if not first <= index < stop:
            parent, _, position = name.rpartition(".")
            model.get_submodule(parent)[int(position)] = Relay(split.baton, name)
    model._vt_pipeline = split
    return split


def keep_last_output(model: nn.Module, spec, split: PipelineSplit) -> None:
    """After the layout (its wrappers and hooks in place): keep the output of the stage's last block."""
    if split.is_last:
        return
    last = dict(spec.named_blocks(model))[split.owned[-1]]

    def keep(module, args, output):
        split.baton.value = output

    last.register_forward_hook(keep)


def pipeline_split(model: nn.Module) -> PipelineSplit | None:
    return getattr(model, "_vt_pipeline", None)


def one_sample_microbatches(part: Slice, count: int) -> list[Slice]:
    """`part` as `count` one-sample slices in order, padded with weight-0 stand-ins (its first row)."""
    out = []
    for m in range(count):
        row = m if m < part.count else 0
        keys = part.keys[m : m + 1] if m < part.count else []
        tensors = {name: t[row : row + 1] for name, t in part.tensors.items()}
        out.append(Slice(part.bucket, part.epoch, keys, tensors, part.first_index + row, int(m < part.count)))
    return out


class _StageModule(nn.Module):
    """What a PipelineStage runs: one microbatch (picked by its index) through `spec.forward` of the stage's
    transformer; returns the activation to send on, or on the last stage the microbatch's scaled loss."""

    def __init__(self, transformer: nn.Module, split: PipelineSplit):
        super().__init__()
        self.transformer = transformer
        self.split = split
        self.run: Callable[[int, nn.Module], torch.Tensor] | None = None  # set per step by the trainer

        # True until the first forward of a new schedule: pipelining's shape inference (see `_probe`)
        self.probing = False

    def forward(self, *received, index: torch.Tensor):
        for r in received:  # gloo sends and receives contiguous tensors only: so must the gradients sent back
            if r.requires_grad:
                r.register_hook(torch.Tensor.contiguous)
        if self.probing:
            self.probing = False
            return self._probe(received, index)
        baton = self.split.baton
        baton.value = None if self.split.is_first else (received[0] if len(received) == 1 else tuple(received))
        try:
            loss = self.run(int(index.reshape(-1)[0]), self.transformer)
            if self.split.is_last:
                return loss
            out = baton.value
            return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()
        finally:
            baton.value = None

    def _probe(self, received: tuple, index: torch.Tensor):
        """The forward pipelining runs once per new schedule to learn the shapes it sends: its inputs on a
        receiving stage are uninitialised buffers, and it backpropagates the result to those inputs only.
        Run without autograd (no gradient, no FSDP2 reduction, nothing accumulated) and tie the outputs to
        the inputs with a zero term, so the shapes are real and the probe's backward touches no parameter."""
        with torch.no_grad():
            out = self.forward(*[r.detach() for r in received], index=index)
        zero = sum((r.sum() * 0 for r in received if r.is_floating_point()), torch.zeros((), device=index.device))

        def tie(t: torch.Tensor) -> torch.Tensor:
            tied = t.detach() + zero.to(t.dtype)
            return tied.requires_grad_(True) if self.split.is_first else tied  # the first stage has no input grads

        return tuple(tie(t) for t in out) if isinstance(out, tuple) else tie(out)


class Pipeline:
    """Runs one micro-step's microbatches through the stages with the configured schedule."""

    def __init__(self, transformer: nn.Module, world, schedule: str):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        self.split = pipeline_split(transformer)
        if self.split is None:
            raise RuntimeError("the transformer was not split into pipeline stages (parallelize with parallel.pp > 1)")
        self.world = world
        self.group = self.split.group
        self.module = _StageModule(transformer, self.split)
        self.schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self._schedules: dict[tuple, object] = {}
        self.params = [(name, p) for name, p in transformer.named_parameters() if p.requires_grad]
        from torch.distributed.fsdp import FSDPModule

        if isinstance(transformer, FSDPModule):
            # Each microbatch's backward is a backward of its own, and FSDP2 reshards the root's parameters
            # at the end of every backward; it gathers them again only in a pre-backward hook on the root's
            # output, which a sending stage never backpropagates through (it sends a block's output). Keep
            # the root (embedders, head: small) gathered until the step's last backward, then reshard it
            # (`run`), so the next forward gathers the weights the optimizer stepped.
            transformer.set_reshard_after_backward(False, recurse=False)
        self.fsdp_root = transformer if isinstance(transformer, FSDPModule) else None

    def _schedule(self, key: tuple, microbatches: int):
        """One stage and schedule per shape of the microbatches: pipelining fixes the shapes it sends at
        its first step."""
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            self.module.probing = True
            stage = PipelineStage(self.module, self.split.stage, self.split.stages, self.world.device, group=self.group)
            self._schedules[key] = self.schedule_class(
                stage, microbatches, loss_fn=lambda output, target: output, scale_grads=False
            )
        return self._schedules[key]

    def run(self, key: tuple, microbatches: int, run: Callable[[int, nn.Module], torch.Tensor]) -> None:
        """Forward and backward of `microbatches` microbatches; `run(m, transformer)` is microbatch m's
        scaled loss (last stage) or the forward that feeds the stage's blocks (the others)."""
        self.module.run = run
        index = torch.arange(microbatches, device=self.world.device)
        schedule = self._schedule(key, microbatches)
        args = (index,) if self.split.is_first else ()
        target = index.float() if self.split.is_last else None
        schedule.step(*args, target=target, return_outputs=False, index=index)
        if self.fsdp_root is not None:
            self.fsdp_root.reshard()

    def sum_replicated_grads(self) -> None:
        """Sum the gradients of the parameters outside the blocks (every stage holds them) over the stages.
        One no stage gave a gradient keeps none, as in one process (AdamW then skips it)."""
        replicated = [p for name, p in self.params if not self.split.owns(name)]
        if not replicated:
            return
        seen = torch.tensor([float(p.grad is not None) for p in replicated], device=self.world.comm_device)
        dist.all_reduce(seen, group=self.group)
        for p, used in zip(replicated, seen.tolist()):
            if not used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=self.group)

    def staged(self, name: str) -> bool:
        return self.split.owns(name)


def gather_stages(state: dict[str, torch.Tensor], split: PipelineSplit) -> dict[str, torch.Tensor]:
    """Every stage's (full, CPU) `state` merged on global rank 0; {} on the other ranks. Object collectives
    over the pp group: each stage's part travels whole, so this is for a LoRA's adapters, not for full
    weights (pp_export.py streams them tensor by tensor) nor checkpoints (DCP writes each rank's part)."""
    parts = [None] * split.stages if dist.get_rank(split.group) == 0 else None  # each pp group's first stage
    dist.gather_object(state, parts, group=split.group, group_dst=0)
    if dist.get_rank() != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def pipeline_micro_step(pipeline: "Pipeline", part: Slice, per_rank: int, scale: float, losses_of) -> torch.Tensor:
    """Forward and backward of this rank's slice `part` through the pipeline stages, one sample per microbatch (at
    least `per_rank` of them, stand-ins padding a smaller bucket); `losses_of(sample, transformer)` is the loss path's
    (loss, audio loss, count) per route. Returns the sum of the per-sample losses on the last stage (0 on the others)."""
    microbatches = one_sample_microbatches(part, max(per_rank, pipeline.split.stages))
    losses: dict[int, torch.Tensor] = {}

    def run(m: int, transformer: nn.Module) -> torch.Tensor:
        total = sum(loss * count for loss, _, count in losses_of(microbatches[m], transformer))
        losses[m] = total.detach().double()
        return total * scale

    key = (part.bucket, *(tuple(t.shape[1:]) for t in part.tensors.values()))
    pipeline.run(key, len(microbatches), run)
    if not pipeline.split.is_last:
        return torch.zeros((), dtype=torch.float64, device=pipeline.world.device)
    return sum(losses[m] for m in range(len(microbatches)))
