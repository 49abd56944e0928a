"""An exponential moving average of the trained weights (`ema.decay`), kept like the weights themselves.

The average holds a float32 copy of every trained tensor (a LoRA's adapters, or a full fine-tune's weights)
under the names torch's state-dict API gives them, so under FSDP2 (or TP) each copy is a DTensor with the
weight's own placements: every rank averages its shard with local ops after each optimizer step, nothing is
gathered. It goes into the DCP checkpoints beside the weights (resumed exactly, also at another world size),
and `swapped_in` puts it into the model for the EMA export (`<run.dir>/ema/`, the same files as the weights')
and, with `ema.validation`, for validation (with `ema.eval`, for the held-out loss).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.train.parts.base import ModelMemory, Part, RunContext

log = get_logger("vt.train.ema")


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        # The trained tensors themselves (the state-dict API's values share their storage), by canonical name.
        self.live = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
        self.average = {name: tensor.detach().clone().float() for name, tensor in self.live.items()}

    @torch.no_grad()
    def update(self) -> None:
        """average <- decay x average + (1 - decay) x weights, shard by shard."""
        for name, average in self.average.items():
            average.lerp_(self.live[name].detach().float(), 1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average, for DCP (a checkpoint's `ema` entry; loaded in place)."""
        return self.average

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The model computes with the average inside the block, with its own weights again after it."""
        kept = {name: tensor.detach().clone() for name, tensor in self.live.items()}
        for name, tensor in self.live.items():
            tensor.copy_(self.average[name])
        try:
            yield
        finally:
            for name, tensor in self.live.items():
                tensor.copy_(kept[name])


def checkpoint_has_ema(path) -> bool:
    """Whether the DCP checkpoint at `path` holds an average (a run started without `ema.decay` has none)."""
    from torch.distributed.checkpoint import FileSystemReader

    return any(key.startswith("ema.") for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata)


class EMAPart(Part):
    """ema.decay: the average updated after each optimizer step, saved and resumed with the checkpoints, exported to
    <run.dir>/ema/, swapped in for validation (ema.validation) and the held-out loss (ema.eval). Memory: a float32
    copy of what trains beside the optimizer's moments, and with ema.validation the trained weights kept while the
    average renders."""

    section = "ema"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.ema.decay is not None or config.ema.eval or config.ema.validation

    def check(self, spec, world_size: int) -> None:
        if self.settings.eval and not (self.settings.decay and self.config.data.eval):
            raise UserError(
                "ema.eval = true computes the held-out loss of the weights' average: it needs ema.decay and "
                "data.eval set"
            )
        if self.settings.validation and not self.settings.decay:
            raise UserError("ema.validation = true renders validation with the weights' average: set ema.decay")

    def start(self, run: RunContext) -> None:
        self.ema = EMA(run.transformer, self.settings.decay)

    def after_optimizer_step(self) -> None:
        self.ema.update()

    def weights_for(self, purpose: str):
        wanted = {"validation": self.settings.validation, "held_out": self.settings.eval}[purpose]
        return self.ema.swapped_in() if wanted else contextlib.nullcontext()

    def exports(self) -> list[tuple[str, contextlib.AbstractContextManager]]:
        return [("ema", self.ema.swapped_in())]

    def checkpoint_state(self) -> dict:
        return {"ema": self.ema.state_dict()}

    def resume_state(self, path) -> dict:
        if checkpoint_has_ema(path):
            return {"ema": self.ema.state_dict()}
        log.warning("%s holds no average of the weights (ema.decay was off): it starts from the resumed weights", path)
        return {}

    def model_memory(self, memory: ModelMemory) -> None:
        if memory.mode == "frozen":
            return
        for name, param in memory.model.named_parameters():
            if param.requires_grad:
                memory.rank.optimizer += memory.layout.local(name, param, 4)

    def run_memory(self, plan) -> None:
        if self.settings.validation and plan.validation:  # the trained weights kept while the average renders
            plan.rank.validation += plan.rank.gradients
