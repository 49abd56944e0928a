"""`parallel.dp_shard = "auto"`: replicate the model (DDP) where it fits each device, else shard it (FSDP2).

For a LoRA the frozen base is most of the model and trains nothing. Replicated, it costs memory but no
communication (DDP all-reduces the adapters' gradients alone); sharded, FSDP2 all-gathers every block's
base weights in the forward and again in the backward. So replicating is the faster layout wherever it
fits (measured on one machine: DDP 1.23x one process, FSDP2 0.82x). Which fits comes from the memory
plan (train/plan.py) of both layouts on this device, against its memory:

- CUDA: the GPU's total memory less HEADROOM (the CUDA context, the allocator's fragmentation);
- CPU: the host's available memory divided among the node's ranks.

The choice is made once, on rank 0 (the others wait for it: all ranks must build the same mesh), and
kept in the run's folder (layout.json, keyed by what the plan reads), so a resume does not plan again.
Explicit degrees (-1 or an integer) are never planned. Nothing is planned either, and the run shards
as with -1, where there is no choice: a world of one data-parallel group, CPU offload (an FSDP2 policy),
an explicit `dp_replicate > 1` (HSDP was asked for), or cp / tp (replication is planned without them).
A full fine-tune is planned like a LoRA: it replicates when its weights, gradients and AdamW state fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vt.shared.log import get_logger
from vt.train.parts import Parts

__all__ = [
    "LayoutChoice",
    "choose",
    "needs_plan",
    "unplanned_reason",
    "device_budget",
    "plan_layout",
    "cached_layout",
    "LAYOUT_FILE",
    "HEADROOM",
]

log = get_logger("vt.train.parallel")

LAYOUT_FILE = "layout.json"
HEADROOM = 0.10  # of a GPU's memory, kept out of the budget
GIB = 2**30


@dataclass(frozen=True)
class LayoutChoice:
    """The data-parallel degrees auto picked, and the one line saying why."""

    dp_replicate: int
    dp_shard: int
    reason: str

    @property
    def replicated(self) -> bool:
        return self.dp_shard == 1 and self.dp_replicate > 1


def choose(replicated_peak: int, sharded_peak: int, budget: int, data_parallel: int) -> LayoutChoice:
    """Replicate over `data_parallel` ranks when the replicated layout's planned peak per rank fits `budget`
    (bytes), else shard over them. The sharded peak is only reported: sharding is the fallback either way."""
    fits = replicated_peak <= budget
    picked = "replicate (DDP)" if fits else "shard (FSDP2)"
    reason = (
        f"parallel.dp_shard = auto: {picked}; planned peak per rank {_size(replicated_peak)} replicated, "
        f"{_size(sharded_peak)} sharded, budget {_size(budget)}"
    )
    return LayoutChoice(data_parallel, 1, reason) if fits else LayoutChoice(1, data_parallel, reason)


def _size(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"


def needs_plan(parallel, world_size: int) -> bool:
    """Whether rank 0 must plan: `dp_shard = "auto"` with a choice to make. Explicit degrees always win."""
    return parallel.dp_shard == "auto" and unplanned_reason(parallel, world_size) is None


def unplanned_reason(parallel, world_size: int) -> str | None:
    """Why `dp_shard = "auto"` needs no plan here (it shards, as -1 would), or None when it must choose."""
    if parallel.cpu_offload:
        return "CPU offload is an FSDP2 policy"
    if parallel.dp_replicate > 1:
        return f"parallel.dp_replicate = {parallel.dp_replicate} is set: the rest shards (HSDP)"
    if parallel.cp > 1 or parallel.tp > 1 or parallel.pp > 1:
        return "replication is planned only without cp, tp and pp"
    if world_size // (parallel.cp * parallel.tp * parallel.dp_replicate * parallel.pp) <= 1:
        return "one data-parallel rank"
    return None


def device_budget(device: torch.device, local_ranks: int) -> tuple[int, str]:
    """Bytes one rank may plan to use on `device`, and where the number comes from."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        return int(total * (1 - HEADROOM)), f"{_size(total)} GPU less {HEADROOM:.0%}"
    available = _host_available()
    return available // max(local_ranks, 1), f"{_size(available)} host memory available / {local_ranks} ranks"


def _host_available() -> int:
    """MemAvailable (Linux), else the free physical pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_layout(config, world_size: int, device: torch.device, local_ranks: int) -> LayoutChoice:
    """Plan both layouts of `config` over `world_size` ranks (train/plan.py, stage 1 left out) and choose."""
    from vt.train.plan import make_plan

    data_parallel = world_size // (config.parallel.cp * config.parallel.tp)
    where = "cuda" if device.type == "cuda" else "cpu"

    def peak(dp_replicate: int, dp_shard: int) -> int:
        parallel = config.parallel.model_copy(update={"dp_replicate": dp_replicate, "dp_shard": dp_shard})
        return make_plan(
            config.model_copy(update={"parallel": parallel}), world_size, where, stage1=False, budget=budget, lean=True
        ).rank.device_total

    budget, source = device_budget(device, local_ranks)
    choice = choose(peak(data_parallel, 1), peak(1, data_parallel), budget, data_parallel)
    return LayoutChoice(choice.dp_replicate, choice.dp_shard, f"{choice.reason} ({source})")


def layout_key(config, world_size: int, device: torch.device, local_ranks: int) -> dict:
    """What the choice depends on: the model, the buckets, what trains and how, the parallel settings, the
    world and the device. A resume with all of these unchanged reuses the cached choice."""
    train = config.train
    return {
        "world_size": world_size,
        "local_ranks": local_ranks,
        "device": device.type,
        "model": config.model.model_dump(mode="json"),
        "buckets": config.buckets.model_dump(mode="json"),
        "train": {name: getattr(train, name) for name in ("mode", "batch_size", "mixed_precision")}
        | {"validation": bool(config.validation.prompts)},
        "parts": {part.section: part.settings.model_dump(mode="json") for part in Parts(config)},
        "parallel": config.parallel.model_dump(mode="json"),
    }


def cached_layout(
    config, world_size: int, device: torch.device, local_ranks: int, run_dir: Path, plan=plan_layout
) -> LayoutChoice:
    """The choice kept in `run_dir`/layout.json when its key matches, else `plan(...)`'s, written there. Logs
    the choice's line either way (rank 0 calls this)."""
    key = layout_key(config, world_size, device, local_ranks)
    path = Path(run_dir) / LAYOUT_FILE
    try:
        kept = json.loads(path.read_text())
        if kept.get("key") == json.loads(json.dumps(key)):
            choice = LayoutChoice(**kept["choice"])
            log.info("%s (kept in %s)", choice.reason, path)
            return choice
    except (OSError, ValueError, TypeError, KeyError):
        pass  # none yet, or unreadable: plan again
    choice = plan(config, world_size, device, local_ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{LAYOUT_FILE}.tmp")
    temporary.write_text(json.dumps({"key": key, "choice": asdict(choice)}, indent=1))
    temporary.replace(path)
    log.info("%s", choice.reason)
    return choice
