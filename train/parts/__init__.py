"""The training parts: one module per option that changes the model, the step or memory (train/parts/base.py says
what a part is). `Parts(config)` holds the parts a config turns on, in the order below, and calls each hook on all of
them: the trainer, the loss path and `vt-train plan` use nothing else of an option.

The order matters where hooks compose: fp8 training converts the model before the layout, and after an optimizer
step fp8's scales are precomputed before the average is updated, the swapped blocks released and the offload arena
given back. A new option: its module here, its section in shared/part_configs.py, its line in PARTS, its test and
its entry in docs/stage2.md.
"""

from __future__ import annotations

import contextlib

from vt.shared.config import Config
from vt.train.parts.activation_offload import ActivationOffloadPart
from vt.train.parts.adapter import AdapterPart
from vt.train.parts.base import Change, ModelMemory, Part, Render, RunContext
from vt.train.parts.block_swap import BlockSwapPart
from vt.train.parts.caption_dropout import CaptionDropoutPart
from vt.train.parts.ema import EMAPart
from vt.train.parts.fp8_training import FP8TrainingPart
from vt.train.parts.frozen_base import FrozenBasePart
from vt.train.parts.guidance import GuidancePart
from vt.train.parts.held_out import HeldOutPart
from vt.train.parts.keep_best import KeepBestPart
from vt.train.parts.lr_schedule import LRSchedulePart
from vt.train.parts.token_budget import TokenBudgetPart
from vt.train.parts.validation_stack import ValidationStackPart
from vt.train.parts.video_metrics import VideoMetricsPart

__all__ = ["PARTS", "Change", "ModelMemory", "Part", "Parts", "Render", "RunContext"]

PARTS: tuple[type[Part], ...] = (
    AdapterPart,
    FrozenBasePart,
    FP8TrainingPart,
    TokenBudgetPart,
    LRSchedulePart,
    CaptionDropoutPart,
    GuidancePart,
    EMAPart,
    BlockSwapPart,
    ActivationOffloadPart,
    HeldOutPart,
    VideoMetricsPart,
    ValidationStackPart,
    KeepBestPart,
)


class Parts:
    """The parts `config` turns on; each method calls one hook on every part (see base.py)."""

    def __init__(self, config: Config):
        self.config = config
        self.all = [cls(config) for cls in PARTS if cls.wanted(config)]
        for part in self.all:
            part.parts = self  # a part may ask another what it does (a DoRA adapter, the frozen base's storage)

    def __iter__(self):
        return iter(self.all)

    def __getitem__(self, section: str) -> Part:
        """The part of `section` (KeyError when the config leaves it off)."""
        for part in self.all:
            if part.section == section:
                return part
        raise KeyError(f"no part {section!r} in this run: its parts are {self.names()}")

    def names(self) -> list[str]:
        return [part.section for part in self.all]

    def check(self, spec, world_size: int) -> None:
        for part in self.all:
            part.check(spec, world_size)

    def check_machine(self, device) -> None:
        for part in self.all:
            part.check_machine(device)

    @staticmethod
    def alternatives(config: Config, gpus: int) -> list[list[Change]]:
        """Each part's settings `vt-train plan --gpu-memory` may try, an axis per part (empty ones left out)."""
        return [axis for axis in (cls.alternatives(config, gpus) for cls in PARTS) if axis]

    def dtypes(self, dtypes):
        for part in self.all:
            dtypes = part.dtypes(dtypes)
        return dtypes

    def build_options(self, spec, trains: bool) -> dict:
        options: dict = {}
        for part in self.all:
            options.update(part.build_options(spec, trains))
        return options

    def convert(self, model, fsdp: bool) -> None:
        for part in self.all:
            part.convert(model, fsdp)

    def start(self, run: RunContext) -> None:
        run.parts = self
        for part in self.all:
            part.start(run)

    def batch(self, batch, first: int, step: int):
        for part in self.all:
            batch = part.batch(batch, first, step)
        return batch

    def forward(self, forward, run: RunContext):
        for part in self.all:
            forward = part.forward(forward, run)
        return forward

    @contextlib.contextmanager
    def forward_context(self):
        with contextlib.ExitStack() as stack:
            for part in self.all:
                stack.enter_context(part.forward_context())
            yield

    def after_backward(self) -> None:
        for part in self.all:
            part.after_backward()

    def after_optimizer_step(self) -> None:
        for part in self.all:
            part.after_optimizer_step()

    def batch_sizes(self, spec, buckets) -> dict[str, int]:
        """bucket name -> samples per global micro-batch: train.batch_size, or as a part sets it (a token budget)."""
        sizes = {bucket.name: self.config.train.batch_size for bucket in buckets}
        for part in self.all:
            sizes = part.batch_sizes(sizes, spec, buckets)
        return sizes

    def scheduler(self, optimizer, max_steps: int):
        schedulers = [s for s in (part.scheduler(optimizer, max_steps) for part in self.all) if s is not None]
        assert len(schedulers) == 1, f"one part schedules the learning rate, not {len(schedulers)}"
        return schedulers[0]

    @contextlib.contextmanager
    def weights_for(self, purpose: str):
        with contextlib.ExitStack() as stack:
            for part in self.all:
                stack.enter_context(part.weights_for(purpose))
            yield

    def exports(self) -> list:
        return [export for part in self.all for export in part.exports()]

    def validation_renders(self) -> list[Render]:
        return [render for part in self.all for render in part.validation_renders()]

    def checkpoint_state(self) -> dict | None:
        state = {key: value for part in self.all for key, value in part.checkpoint_state().items()}
        return state or None

    def resume_state(self, path) -> dict | None:
        state = {key: value for part in self.all for key, value in part.resume_state(path).items()}
        return state or None

    def after_resume(self, step: int) -> None:
        for part in self.all:
            part.after_resume(step)

    def step_metrics(self, model, step: int) -> dict:
        return {key: value for part in self.all for key, value in part.step_metrics(model, step).items()}

    def final_metrics(self, model, step: int) -> dict:
        return {key: value for part in self.all for key, value in part.final_metrics(model, step).items()}

    def after_validation(self, step: int, videos: list) -> list[tuple[int, dict]]:
        return [record for part in self.all for record in part.after_validation(step, videos)]

    def after_run(self) -> list[tuple[int, dict]]:
        return [record for part in self.all for record in part.after_run()]

    def logged(self, step: int, record: dict) -> None:
        for part in self.all:
            part.logged(step, record)

    def trace_key(self) -> tuple:
        return tuple((part.section, part.trace_key()) for part in self.all if part.trace_key())

    def model_memory(self, memory: ModelMemory) -> None:
        for part in self.all:
            part.model_memory(memory)

    def run_memory(self, plan) -> None:
        for part in self.all:
            part.run_memory(plan)

    def activation_kind(self, kind: str, device: str) -> str:
        for part in self.all:
            kind = part.activation_kind(kind, device)
        return kind

    def transfers(self, plan) -> tuple[float, float]:
        moved = [part.transfers(plan) for part in self.all]
        return sum(m for m, _ in moved), sum(e for _, e in moved)
