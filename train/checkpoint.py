"""DCP checkpoints: trainable weights + optimizer (sharded, resharding-safe), plus a small JSON state.

A checkpoint folder `step-NNNNNN/` is complete once `state.json` exists: it is written after DCP has
finished, so a crash mid-save leaves a folder that `latest()` ignores. A LoRA run stores only the
trainable (adapter) parameters and their optimizer state, never the frozen base weights.

DCP writes each rank's shards plus a global index, so a checkpoint saved by N ranks loads into any
other layout (FSDP2 at another world size, DDP, one process): names are the model's own, without
wrapper segments (DDP, activation checkpointing). The folder must be on storage every rank sees.
The small JSON state (step, scheduler, data cursor) is global and written by rank 0 alone.

`gather_full_state_dict` is the export path: one call on every rank leaves the unsharded weights
on rank 0's CPU (tensors gathered one after another, no barrier per parameter).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from vt.shared.adapters import is_adapter, saved_name
from vt.train.parallel.pp import gather_stages, pipeline_split

STATE_FILE = "state.json"
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    def __init__(self, folder: Path, keep: int = 2):
        self.folder = Path(folder)
        self.keep = keep

    def complete(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.glob("step-*") if (p / STATE_FILE).is_file())

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        trainer_state: dict,
        extra: dict[str, dict] | None = None,
    ) -> Path:
        """`extra`: more state dicts of tensors to keep beside the weights (`ema`: train/parts/ema.py), sharded alike."""
        path = self.folder / f"step-{step:06d}"
        if _is_main() and path.exists():
            shutil.rmtree(path)  # an incomplete save of this step from a crashed run
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        dcp.save({"model": model_sd, "optim": optim_sd, **(extra or {})}, checkpoint_id=str(path))
        _barrier()
        if _is_main():
            state = {"step": step, "scheduler": scheduler.state_dict(), **trainer_state}
            tmp = path / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps(state, indent=1))
            tmp.replace(path / STATE_FILE)
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return path

    def load(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        extra: dict[str, dict] | None = None,
    ) -> dict:
        """`extra`: the state dicts `save` kept beside the weights, loaded in place."""
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        state_dict = {"model": model_sd, "optim": optim_sd, **(extra or {})}
        dcp.load(state_dict, checkpoint_id=str(path))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
        state = json.loads((Path(path) / STATE_FILE).read_text())
        scheduler.load_state_dict(state.pop("scheduler"))
        return state


def gather_full_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Unsharded weights (only trainable ones if asked) on rank 0's CPU; {} on other ranks.

    Every rank must call it (the shards are all-gathered). Single-process: a CPU copy of the state.
    """
    if not dist.is_initialized():
        state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
        return {k: v.detach().cpu() for k, v in state.items()}
    split = pipeline_split(model)
    if split is not None:  # pipeline stages: each stage's ranks gather their part, rank 0 merges them
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=trainable_only)
        state = {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=options).items()}
        return gather_stages(state, split)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    return state if _is_main() else {}


def lora_weights(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter weights of a local (unsharded) model under peft's saved names (`...lora_A.weight`, or another
    kind's: shared/adapters.py).

    Names come from torch's state-dict API, which strips wrapper segments (activation checkpointing,
    compile); peft's own `get_peft_model_state_dict` finds nothing in a model with wrapped blocks.
    """
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {saved_name(name, adapter): tensor.detach().cpu() for name, tensor in state.items() if is_adapter(name)}
