"""A training part: one option that changes the model, the step or memory, with everything it does in one module.

A part owns its config section (shared/part_configs.py), its checks, the hooks below and its memory model for
`vt-train plan`. The trainer and the plan hold the run's parts in a `Parts` and call each hook on all of them, in
the order of `vt.train.parts.PARTS`; neither branches on an option. Every hook is optional (the base does nothing).

- checks: `check(spec, world_size)` before anything is built (the trainer and the plan alike), `check_machine(device)`
  at the trainer's start-up only (a plan is made for another machine);
- the model: `build_options(trains)` (what the transformer is built with), `convert(model, fsdp)` before the
  parallel layout, `start(run)` once it is built (`RunContext`);
- the step: `batch(batch, first, step)` on each global micro-batch, `forward(forward, run)` around the family's
  forward, `forward_context()` around each forward, `after_backward()`, `after_optimizer_step()`,
  `batch_sizes(sizes, spec, buckets)` for the samples per bucket, `scheduler(optimizer, max_steps)`;
- the weights outside the step: `weights_for(purpose)` ("validation", "held_out") and `exports()`;
- validation: `validation_renders()`, more videos of each prompt (a stacked LoRA's);
- checkpoints: `checkpoint_state()` to save, `resume_state(path)` to load into, `after_resume(step)`;
- metrics: `step_metrics(model, step)` after each optimizer step, `final_metrics(model, step)` at the end;
  `after_validation(step, videos)` after each validation (the videos this rank wrote) and `after_run()` after the last,
  each returning records (step, metrics) for rank 0 to log; `logged(step, record)` after each record metrics.jsonl
  gets (every rank alike);
- memory: `model_memory(memory)` for each transformer the plan builds, `run_memory(plan)` once its trace is in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vt.shared.config import Config


@dataclass
class RunContext:
    """What a part may use once the model is built (`Part.start`); the plan passes the fields it has."""

    spec: Any
    device: torch.device
    transformer: torch.nn.Module | None = None
    world: Any = None
    empty_caption: Callable[[], dict[str, torch.Tensor]] | None = None
    loss_path: Any = None  # the run's LossPath (train/step.py), set before the first step
    shards_check: Callable | None = None  # the window's provenance check (train/window_match.py)
    staged: Callable | None = None  # pipeline stages: each held-out forward as one pass over them
    parts: Any = None  # the run's Parts: a part may ask the others (the weights for validation, the held-out loss)


@dataclass(frozen=True)
class Change:
    """One setting `vt-train plan --gpu-memory` may try (train/plan_search.py): `section_values` applied to a config."""

    axis: str
    label: str
    section_values: tuple  # ((section, {key: value}), ...)
    gpus: int | None = None  # another GPU count

    def apply(self, config: Config) -> Config:
        for section, values in self.section_values:
            config = config.model_copy(update={section: getattr(config, section).model_copy(update=dict(values))})
        return config


def change(axis: str, label: str, section: str, gpus: int | None = None, **values) -> Change:
    return Change(axis, label, ((section, tuple(sorted(values.items()))),) if values else (), gpus)


def with_checkpointing(settings: Change) -> Change:
    """`settings` and parallel.activation_checkpointing = true (what block swap and activation offload need)."""
    return Change(
        settings.axis,
        settings.label,
        (("parallel", (("activation_checkpointing", True),)), *settings.section_values),
        settings.gpus,
    )


@dataclass(frozen=True)
class Render:
    """One more video of each validation prompt (`Part.validation_renders`), `<prompt>-<name>.mp4` beside the plain
    one at every validation and among the base's renders: rendered inside `context(transformer)` (every rank enters
    it alike), with `steps` sampling steps (None: validation.steps) and the pipeline call's `arguments` ((name, value),
    ...: a sampler's guidance scale). `key` names what decides its videos (files, strengths): the base's renders are
    reused only while every render's key is the same."""

    name: str
    context: Callable[[torch.nn.Module], contextlib.AbstractContextManager]
    steps: int | None = None
    arguments: tuple = ()
    key: str = ""


@dataclass
class ModelMemory:
    """One transformer the plan built (train/plan.py), for `Part.model_memory`: the part adds its bytes to `rank`."""

    spec: Any
    model: torch.nn.Module
    mode: str  # "lora", "full", or "frozen" (validation's other expert)
    layout: Any  # the plan's per-tensor layout: layout.local(name, tensor, bytes_per) is one rank's bytes
    rank: Any  # the RankPlan being filled
    dtypes: Any  # the run's Dtypes (train/model_build.py)
    widest: int = 0  # the most one layer's weight takes while it computes (dequantized, upcast)
    dequantized: int = 0  # bytes a quantized base unpacks in one pass over the trained model (train/step_cost.py)


class Part:
    section: ClassVar[str] = ""  # the config section the part owns

    def __init__(self, config: Config):
        self.config = config
        self.settings = getattr(config, self.section) if self.section else None

    @classmethod
    def wanted(cls, config: Config) -> bool:
        """Whether `config` turns the part on (a part off is not in the run's `Parts`)."""
        return True

    def check(self, spec, world_size: int) -> None: ...

    def check_machine(self, device: torch.device) -> None: ...

    @classmethod
    def alternatives(cls, config: Config, gpus: int) -> list[Change]:
        """The settings of this part `vt-train plan --gpu-memory` may try to make `config` fit (one axis)."""
        return []

    def dtypes(self, dtypes):
        """The run's Dtypes (train/model_build.py) as the part changes them."""
        return dtypes

    def build_options(self, spec, trains: bool) -> dict:
        return {}

    def convert(self, model: torch.nn.Module, fsdp: bool) -> None: ...

    def start(self, run: RunContext) -> None: ...

    def batch(self, batch, first: int, step: int):
        return batch

    def forward(self, forward: Callable, run: RunContext) -> Callable:
        """The step's forward as the part changes it (`run`: the spec and the empty caption; the plan's trace passes
        its own)."""
        return forward

    def forward_context(self):
        return contextlib.nullcontext()

    def after_backward(self) -> None: ...

    def after_optimizer_step(self) -> None: ...

    def batch_sizes(self, sizes: dict[str, int], spec, buckets) -> dict[str, int]:
        return sizes

    def scheduler(self, optimizer: torch.optim.Optimizer, max_steps: int):
        return None

    def weights_for(self, purpose: str):
        return contextlib.nullcontext()

    def exports(self) -> list[tuple[str, Any]]:
        return []

    def validation_renders(self) -> list[Render]:
        return []

    def checkpoint_state(self) -> dict:
        return {}

    def resume_state(self, path) -> dict:
        return {}

    def after_resume(self, step: int) -> None:
        """The checkpoint of optimizer step `step` is loaded."""

    def step_metrics(self, model: torch.nn.Module, step: int) -> dict:
        return {}

    def final_metrics(self, model: torch.nn.Module, step: int) -> dict:
        return {}

    def after_validation(self, step: int, videos: list) -> list[tuple[int, dict]]:
        """Validation of optimizer step `step` wrote `videos` on this rank (every rank calls it): records (step,
        metrics) to log now (rank 0 logs them)."""
        return []

    def after_run(self) -> list[tuple[int, dict]]:
        """The run's last validation is done (every rank calls it): the records still to log."""
        return []

    def logged(self, step: int, record: dict) -> None:
        """Step `step`'s record went to metrics.jsonl (every rank calls it with the same record, at the same steps)."""

    def trace_key(self) -> tuple:
        """What of the part changes the plan's traced step (its activations): the plan caches traces by it."""
        return ()

    def model_memory(self, memory: ModelMemory) -> None: ...

    def run_memory(self, plan) -> None: ...

    def activation_kind(self, kind: str, device: str) -> str:
        """Which traced step the run's is ("none", "checkpointing", "offload"), as the part changes it."""
        return kind

    def transfers(self, plan) -> tuple[float, float]:
        """Bytes the part moves over PCIe per micro-batch (overlapped with compute) and bytes of them that cannot
        overlap (train/step_cost.py)."""
        return 0.0, 0.0
