"""What would make a run fit: `vt-train plan --gpu-memory N` tries settings alone and together and lists those that
fit, quickest first.

Each setting is a change on one axis (a narrow base, activation checkpointing, activation offload, block swap depth,
CPU offload, context parallel degree, more GPUs, a tiled validation decode). The search plans every single change and
every pair of changes on different axes (block swap and activation offload imply checkpointing; more GPUs and CPU
offload are tried alone), each also with the micro-batch split into gradient accumulation (`train.batch_size` per
rank 1, `train.grad_accum` times more: the same global batch), each through `make_plan`, which refuses what
the trainer refuses (train/refusals.py) so nothing listed would stop at start-up. Of those that fit the device budget
(and `--host-memory`, when given) it keeps the minimal ones (a pair is dropped when one of its changes fits alone)
and orders them by the step-time estimate (train/step_cost.py).
"""

from __future__ import annotations

import itertools

from vt.shared.buckets import parse_buckets
from vt.shared.config import Config
from vt.shared.models import spec_for
from vt.shared.models.plans import Unplanned
from vt.train.parts import Change, Parts
from vt.train.parts.base import change

CHECKPOINTED = {"activation_checkpointing": True}

GIB = 2**30
ALONE = ("gpus", "cpu_offload")  # axes tried without a partner


def _axes(config: Config, gpus: int) -> list[list[Change]]:
    """The training parts' own axes (a narrow base, block swap, activation offload: vt.train.parts), then the
    layout's."""
    train, parallel = config.train, config.parallel
    spec = spec_for(config)
    axes: list[list[Change]] = Parts.alternatives(config, gpus)
    if not parallel.activation_checkpointing:
        axes.append([change("checkpointing", "parallel.activation_checkpointing=true", "parallel", **CHECKPOINTED)])
    if not parallel.cpu_offload:
        axes.append([change("cpu_offload", "parallel.cpu_offload=true", "parallel", cpu_offload=True)])
    try:
        has_cp = spec.cp_plan() is not None
    except Unplanned:
        has_cp = False
    cps = [
        cp for cp in (2, 4, 8) if has_cp and cp > parallel.cp and gpus % (cp * parallel.tp * parallel.dp_replicate) == 0
    ]
    if cps:
        axes.append([change("cp", f"parallel.cp={cp}", "parallel", cp=cp) for cp in cps])
    axes.append([change("gpus", f"{more} GPUs (FSDP2)", "", more) for more in (2, 4, 8, 16, 32) if more > gpus])
    per_rank = -(-train.batch_size // max(gpus, 1))
    sizes = Parts(config).batch_sizes(spec, parse_buckets(config.buckets.sizes))
    plain = all(size == train.batch_size for size in sizes.values())  # no token budget sets its own
    if plain and per_rank > 1 and train.batch_size % per_rank == 0:
        axes.append(
            [
                change(
                    "split",
                    f"train.batch_size={train.batch_size // per_rank} + train.grad_accum={train.grad_accum * per_rank}",
                    "train",
                    batch_size=train.batch_size // per_rank,
                    grad_accum=train.grad_accum * per_rank,
                )
            ]
        )
    validation = config.validation
    if validation.prompts and validation.vae_tiling is not True and spec.vae_tiles:
        axes.append([change("tiling", "validation.vae_tiling=true", "validation", vae_tiling=True)])
    return [axis for axis in axes if axis]


def combinations(config: Config, gpus: int) -> list[tuple[Change, ...]]:
    """Every single change and every pair on two axes (but those tried alone), each also with the micro-batch split
    into gradient accumulation (the same global batch, a smaller step), where the batch can split."""
    axes = _axes(config, gpus)
    split = [change for axis in axes for change in axis if change.axis == "split"]
    axes = [axis for axis in axes if axis[0].axis != "split"]
    out = [(change,) for axis in axes for change in axis]
    for first, second in itertools.combinations([axis for axis in axes if axis[0].axis not in ALONE], 2):
        out += list(itertools.product(first, second))
    if split:
        out += [(split[0],)] + [(*combo, split[0]) for combo in out if combo[0].axis not in ALONE]
    return out


def alternatives(
    config: Config, gpus: int, device: str, budget: int | None = None, host_budget: int | None = None
) -> list[tuple[str, object]]:
    """(label, plan) of every combination the trainer would run (refused ones left out); with `budget` (and
    `host_budget`) only the minimal ones that fit, quickest first."""
    from vt.train.plan import make_plan
    from vt.train.step_cost import by_step_time

    planned: dict[tuple[Change, ...], object] = {}
    for combo in combinations(config, gpus):
        changed = config
        for setting in combo:
            changed = setting.apply(changed)
        count = next((setting.gpus for setting in combo if setting.gpus), gpus)
        try:
            planned[combo] = make_plan(changed, count, device, budget=budget, stage1=False, lean=True)
        except ValueError:  # refused (a UserError, Unplanned, ParallelConfigError: all ValueErrors)
            continue
    if budget is None:
        return [(_label(combo), plan) for combo, plan in planned.items()]
    fits = {
        combo: plan
        for combo, plan in planned.items()
        if plan.rank.device_total <= budget and (host_budget is None or plan.rank.host_peak <= host_budget)
    }
    minimal = {
        combo: plan
        for combo, plan in fits.items()
        if not any(len(other) < len(combo) and set(other) <= set(combo) for other in fits)
    }
    base = make_plan(config, gpus, device, budget=budget, stage1=False, lean=True)
    return [(label, plan) for label, plan, _ in by_step_time(base, [(_label(c), p) for c, p in minimal.items()])]


def _label(combo: tuple[Change, ...]) -> str:
    return " + ".join(change.label for change in combo)


def format_fits(base, fitting: list[tuple[str, object]], budget_gib: float, host_gib: float | None) -> list[str]:
    """The lines `vt-train plan --gpu-memory` ends with: what fits, quickest first, each with its device and host
    memory and its step time against the config as is."""
    from vt.train.step_cost import CARD, by_step_time

    where = f"{budget_gib:g} GiB" + (f" with {host_gib:g} GiB of host memory" if host_gib else "")
    lines = [
        f"what fits {where}, quickest first (step time against the config as is, estimated at "
        f"{CARD.flops / 1e12:g} TFLOPS, {CARD.pcie / 1e9:g} GB/s over PCIe and {CARD.memory / 1e12:g} TB/s of "
        "device memory: train/step_cost.py):"
    ]
    rows = by_step_time(base, fitting)
    for label, plan, ratio in rows[:10]:
        lines.append(
            f"  {label}: {plan.rank.device_total / GIB:.1f} GiB on the GPU, "
            f"{plan.rank.host_peak / GIB:.1f} GiB host" + (f", ~{ratio:.2f}x" if ratio is not None else "")
        )
    if not rows:
        lines.append("  none of the settings tried, alone or in pairs")
    elif len(rows) > 10:
        lines.append(f"  ... and {len(rows) - 10} more")
    return lines
