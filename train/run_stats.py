"""What a run reports about itself besides its losses: its autocast dtype, peak memory (memory.json), the step's
rates, the check that stops a non-finite step before the optimizer applies it, and the sample log (log.samples)."""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vt.shared.errors import UserError
from vt.shared.host_memory import pinned_bytes


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    if setting == "no":
        return None
    supported = device.type != "cpu" and _bf16_supported(device)
    if setting == "bf16" and not supported and device.type != "cpu":
        raise UserError(f"train.mixed_precision = 'bf16' is not supported on {device}; use 'no'")
    if setting == "bf16" or supported:
        return torch.bfloat16
    return None


def _bf16_supported(device: torch.device) -> bool:
    """Whether `device`'s backend (torch.cuda, torch.xpu, or any registered one) computes in bfloat16."""
    check = getattr(getattr(torch, device.type, None), "is_bf16_supported", None)
    return bool(check is not None and check())


def host_peak_gb() -> float:
    """This process's peak resident set so far, in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def host_values(metrics: dict) -> dict:
    """`metrics` with its tensors read to Python floats, in one host read (one sync on a GPU)."""
    names = [name for name, value in metrics.items() if isinstance(value, torch.Tensor)]
    if not names:
        return dict(metrics)
    device = metrics[names[0]].device
    read = torch.stack([metrics[name].detach().to(device, torch.float64).reshape(()) for name in names]).tolist()
    return {**metrics, **dict(zip(names, read))}


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory: allocated GPU memory on CUDA, peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_gb()


@dataclass
class StepStats:
    samples: int = 0
    tokens: int = 0
    data_wait: float = 0.0
    started: float = field(default_factory=time.perf_counter)


def stop_if_not_finite(step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Raise FloatingPointError before the optimizer applies a step whose loss or gradient norm is NaN or infinite.
    Both are global (summed and combined over every rank), so every rank raises together, with no collective: the
    step's one host read (the CPU waits for the backward here, not for the optimizer or the next step's inputs)."""
    loss_value, norm = torch.stack([loss.double(), grad_norm.to(loss.device, torch.float64)]).tolist()
    if math.isfinite(loss_value) and math.isfinite(norm):
        return
    what = f"loss is {loss_value}" if not math.isfinite(loss_value) else f"gradient norm is {norm} (loss {loss_value})"
    raise FloatingPointError(
        f"{what} at step {step}, which the optimizer did not apply (the weights are step "
        f"{step - 1}'s, as in its checkpoint); lower train.lr or check the data"
    )


def write_memory(run_dir: Path, world, device: torch.device, baseline_gb: float, startup_peak_gb: float) -> None:
    """<run.dir>/memory.json: every rank's peak over the whole run (validation and export included): host resident
    set, the part of it that was there before the trainer built anything (imports), the host memory vt page-locked
    (block swap's and activation offload's arenas), and on CUDA the peak allocated GPU memory, over the run and over
    start-up alone. Every rank calls it (a gather)."""
    memory = {
        "host_peak_gb": world.gather_floats(host_peak_gb()),
        "host_baseline_gb": world.gather_floats(baseline_gb),
        "host_pinned_gb": world.gather_floats(pinned_bytes() / 2**30),
    }
    if device.type == "cuda":
        memory["gpu_peak_gb"] = world.gather_floats(peak_memory_gb(device))
        memory["gpu_startup_peak_gb"] = world.gather_floats(startup_peak_gb)
    if world.is_main:
        (run_dir / "memory.json").write_text(json.dumps(memory, indent=1))


def log_samples(run_dir: Path, world, step: int, micro: list, parts: list) -> None:
    """log.samples: optimizer step `step`'s global keys (rank 0) and, when distributed, each rank's own slice; where
    samples have several captions, which one each sample of the rows read trained on (`captions`: key -> position)."""
    if world.is_main:
        with open(run_dir / "samples.jsonl", "a") as f:
            for batch in micro:
                record = {"step": step, "epoch": batch.epoch, "bucket": batch.bucket, "keys": batch.keys}
                record.update({"captions": batch.captions} if batch.captions else {})  # its read rows' caption choice
                f.write(json.dumps(record) + "\n")
    if not world.dims.distributed:
        return
    folder = run_dir / "samples"
    folder.mkdir(exist_ok=True)
    coordinate = world.dims.coordinate(world.rank)
    with open(folder / f"rank{world.rank}.jsonl", "a") as f:
        for index, part in enumerate(parts):
            record = {"step": step, "micro": index, "epoch": part.epoch, "bucket": part.bucket, "keys": part.keys}
            chosen = {key: micro[index].captions[key] for key in part.keys if key in micro[index].captions}
            record.update({"captions": chosen} if chosen else {})  # which of its captions each sample trained on
            f.write(json.dumps({**record, "dp_rank": world.dp_rank, **coordinate}) + "\n")


class StepLog:
    """When a step is logged and what its record holds: the step's metrics plus rates since the last log (samples,
    transformer tokens), data wait and every rank's peak memory. `due` answers alike on every rank (`log` holds a
    collective): by steps every rank computes it; by seconds rank 0's tracker decides (the others' are disabled) and,
    in a distributed run, broadcasts it over the CPU backend (no GPU sync)."""

    def __init__(self, settings, world, tracker, report):
        self.settings, self.world, self.tracker, self.report = settings, world, tracker, report
        self.logged: dict = {}  # the last logged step's values (a final held-out loss joins them)

    def due(self, step: int) -> bool:
        every_steps, every_seconds = self.settings.every_steps, self.settings.every_seconds
        if every_steps and step % every_steps == 0:
            return True
        if not every_seconds:
            return False
        return bool(self.world.broadcast_object(self.tracker.due(step)))

    def log(self, step: int, metrics: dict, stats: StepStats) -> float:
        """Write step `step`'s record (every rank calls it at the same steps); returns its loss."""
        values = host_values(metrics)  # the one read of the step's device tensors
        elapsed = max(time.perf_counter() - stats.started, 1e-9)
        values.update(samples_s=stats.samples / elapsed, tokens_s=stats.tokens / elapsed, data_wait_s=stats.data_wait)
        memory = self.world.gather_floats(peak_memory_gb(self.world.device))
        values.update({f"peak_mem_gb/rank{r}": m for r, m in enumerate(memory)})
        self.tracker.log(step, values, force=True)
        self.logged = values
        self.report.update()  # report.html, at most every log.report_every_seconds
        return values["loss"]
