"""An exponential moving average of the trained weights (`train.ema_decay`), kept like the weights themselves.

The average holds a float32 copy of every trained tensor (a LoRA's adapters, or a full fine-tune's weights)
under the names torch's state-dict API gives them, so under FSDP2 (or TP) each copy is a DTensor with the
weight's own placements: every rank averages its shard with local ops after each optimizer step, nothing is
gathered. It goes into the DCP checkpoints beside the weights (resumed exactly, also at another world size),
and `swapped_in` puts it into the model for the EMA export (`<run.dir>/ema/`, the same files as the weights')
and, with `train.ema_validation`, for validation (with `train.ema_eval`, for the held-out loss).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from vt.shared.log import get_logger

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
    """Whether the DCP checkpoint at `path` holds an average (a run started without `train.ema_decay` has none)."""
    from torch.distributed.checkpoint import FileSystemReader

    return any(key.startswith("ema.") for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata)
