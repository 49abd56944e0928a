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
from dataclasses import dataclass

from vt.shared.config import Config
from vt.shared.models import spec_for
from vt.shared.models.plans import Unplanned

GIB = 2**30
ALONE = ("gpus", "cpu_offload")  # axes tried without a partner


@dataclass(frozen=True)
class Change:
    axis: str
    label: str
    section_values: tuple  # ((section, {key: value}), ...)
    gpus: int | None = None  # another GPU count

    def apply(self, config: Config) -> Config:
        for section, values in self.section_values:
            config = config.model_copy(update={section: getattr(config, section).model_copy(update=dict(values))})
        return config


def _change(axis: str, label: str, section: str, gpus: int | None = None, **values) -> Change:
    return Change(axis, label, ((section, tuple(sorted(values.items()))),) if values else (), gpus)


def _axes(config: Config, gpus: int) -> list[list[Change]]:
    train, parallel = config.train, config.parallel
    spec = spec_for(config)
    checkpointed = {"activation_checkpointing": True}
    axes: list[list[Change]] = []
    if train.mode == "lora" and not train.fp8_base_weights and train.quantize_base == "none":
        axes.append(
            [_change("base", "train.fp8_base_weights=true", "train", fp8_base_weights=True)]
            + [_change("base", f"train.quantize_base={kind}", "train", quantize_base=kind) for kind in ("int8", "nf4")]
        )
    if not parallel.activation_checkpointing:
        axes.append([_change("checkpointing", "parallel.activation_checkpointing=true", "parallel", **checkpointed)])
    if not parallel.activation_offload:
        axes.append(
            [
                _change(
                    "offload", "parallel.activation_offload=true", "parallel", **checkpointed, activation_offload=True
                )
            ]
        )
    if gpus == 1 and train.mode == "lora" and parallel.blocks_on_gpu is None:
        axes.append(
            [
                _change(
                    "swap", f"parallel.blocks_on_gpu={resident}", "parallel", **checkpointed, blocks_on_gpu=resident
                )
                for resident in (20, 10, 5, 0)
            ]
        )
    if not parallel.cpu_offload:
        axes.append([_change("cpu_offload", "parallel.cpu_offload=true", "parallel", cpu_offload=True)])
    try:
        has_cp = spec.cp_plan() is not None
    except Unplanned:
        has_cp = False
    cps = [
        cp for cp in (2, 4, 8) if has_cp and cp > parallel.cp and gpus % (cp * parallel.tp * parallel.dp_replicate) == 0
    ]
    if cps:
        axes.append([_change("cp", f"parallel.cp={cp}", "parallel", cp=cp) for cp in cps])
    axes.append([_change("gpus", f"{more} GPUs (FSDP2)", "", more) for more in (2, 4, 8, 16, 32) if more > gpus])
    per_rank = -(-train.batch_size // max(gpus, 1))
    if train.tokens_per_batch is None and per_rank > 1 and train.batch_size % per_rank == 0:
        axes.append(
            [
                _change(
                    "split",
                    f"train.batch_size={train.batch_size // per_rank} + train.grad_accum={train.grad_accum * per_rank}",
                    "train",
                    batch_size=train.batch_size // per_rank,
                    grad_accum=train.grad_accum * per_rank,
                )
            ]
        )
    if train.validation_prompts and train.validation_vae_tiling is not True and spec.vae_tiles:
        axes.append([_change("tiling", "train.validation_vae_tiling=true", "train", validation_vae_tiling=True)])
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
        for change in combo:
            changed = change.apply(changed)
        count = next((change.gpus for change in combo if change.gpus), gpus)
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
