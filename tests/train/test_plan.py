"""`vt-train plan` from config files alone: every family's training step runs on fake tensors, weights and
their sharding are the trainer's own, and the fake-tensor peak counter measures what ops allocate."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from vt.shared.config import Config, build
from vt.shared.memory_trace import PeakLive, fake_mode, peak_bytes
from vt.shared.models import FAMILIES, spec_for

from helpers.cli_runs import sectioned
from helpers.family_cases import bucket_of


def config_for(model: Path, family: str, **sections) -> Config:
    """A plan's config: train keys or sections by name (cli_runs.sectioned) over a batch of 2 and one prompt."""
    train, sections = sectioned({"batch_size": 2, "validation": {"prompts": ["a fox"]}}, sections)
    return build(
        Config,
        {
            "model": {"family": family, "path": str(model), "max_text_tokens": 16},
            "buckets": {"sizes": [bucket_of(family).name]},  # the family's test bucket (its tester entry)
            "train": train,
            **sections,
        },
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_plans_from_its_configs(tiny_model_factory, family):
    from vt.train.model_build import prepare_transformer
    from vt.train.plan import make_plan

    config = config_for(tiny_model_factory(family), family)
    one, two = make_plan(config, 1, "cpu"), make_plan(config, 2, "cpu")
    spec = spec_for(config)

    def weight_bytes(component: str, mode: str) -> int:
        built = prepare_transformer(
            spec,
            component,
            mode=mode,
            lora={"rank": 16, "alpha": 16.0, "targets": []},
            storage_dtype=None,
            sharded=False,
            compute_dtype=torch.float32,
            frozen_dtype=torch.float32,
        )
        return sum(p.numel() * p.element_size() for p in built.parameters())

    expected = weight_bytes(spec.trained_component, "lora")
    # A one-expert run also holds the other experts (Wan 2.2's), frozen, for validation.
    expected += sum(weight_bytes(c, "frozen") for c, _ in spec.experts().values() if c != spec.trained_component)
    assert one.rank.weights == pytest.approx(expected, rel=0.01)
    assert two.rank.weights < 0.6 * one.rank.weights and two.rank.buffers > 0  # FSDP2 shards, gathers blocks
    bucket = next(iter(one.activations.values()))
    assert 0 < bucket["checkpointing"] <= bucket["none"]  # at tiny sizes the blocks may hold the least of it
    if family == "wan":
        assert bucket["checkpointing"] < 0.8 * bucket["none"]
    assert one.rank.validation > 0 and one.stage1["text_encoder"] > 0 and one.stage1["working"] > 0


def test_plan_command_says_what_fits(tiny_model_factory, tmp_path):
    from typer.testing import CliRunner

    from vt.shared.config import to_toml
    from vt.train.cli import app

    path = tmp_path / "run.toml"
    path.write_text(to_toml(config_for(tiny_model_factory("wan"), "wan", mode="full")))
    # The command in this process (typer's runner, no interpreter start-up): the --json plan below reuses its traces.
    out = CliRunner().invoke(app, ["plan", str(path), "--gpus", "2", "--gpu-memory", "0.001", "--device", "cpu"])
    assert out.exit_code == 0, (out.output[-2000:], out.exception)
    assert "(FSDP2)" in out.stdout and "does NOT fit" in out.stdout and "what fits" in out.stdout
    assert "parallel.dp_shard = auto: shard (FSDP2); planned peak per rank" in out.stdout  # the default, planned
    from vt.shared.config import load_config
    from vt.train.cli import auto_layout_for_plan

    roomy, line = auto_layout_for_plan(load_config(path), 2, "cpu", 100.0)  # what `--gpu-memory 100` would plan
    assert (roomy.parallel.dp_replicate, roomy.parallel.dp_shard) == (2, 1)
    assert line.startswith("parallel.dp_shard = auto: replicate (DDP); planned peak per rank")
    assert "budget 100.00 GiB" in line
    printed = CliRunner().invoke(app, ["plan", str(path), "--json"])
    assert printed.exit_code == 0, (printed.output[-2000:], printed.exception)
    plan = json.loads(printed.stdout)
    rank = plan["per_rank_bytes"]
    assert rank["gradients"] * 2 == rank["optimizer"] and rank["validation"] > 0
    # Phases: what stays resident, plus the larger of training (gradients, activations) and validation.
    assert rank["resident"] == rank["weights"] + rank["optimizer"] + rank["buffers"]
    assert rank["total"] == rank["resident"] + max(rank["gradients"] + rank["activations"], rank["validation"])


def test_peak_counter_counts_what_ops_allocate_not_views_of_weights():
    with fake_mode():
        weight = torch.nn.Linear(1000, 1000)  # 4 MB of weights, there before the region
        x = torch.zeros(1000, 1000)
        with peak_bytes() as tracker, torch.no_grad():
            for _ in range(5):
                x = weight(x)  # reads weight.t(): a view, no new memory
            y = x.view(-1)  # a view of an activation: no new memory
        assert tracker.current() == 4_000_000 and y.numel() == 1_000_000
        assert tracker.peak == 8_000_000  # the previous output and the new one, at the moment both exist


@pytest.mark.parametrize("family, task", [("wan", "t2v"), ("hunyuan-video-1.5", "i2v")])
def test_a_gpu_plan_traces_under_the_runs_autocast(tiny_model_factory, tmp_path, family, task):
    """The trace's fake tensors live on the CPU whatever the target; a CUDA plan still casts as the run
    casts under bf16 autocast (HunyuanVideo 1.5's bmm of fp32 and bf16 failed when CUDA autocast was off),
    and a forward that branches on a condition's values (HunyuanVideo 1.5 I2V: all-zero image embeddings
    mean t2v) reads real ones,
    so its activations are smaller than the float32 ones of a CPU plan (at tiny widths the norms and
    positional tables autocast keeps in float32 weigh much: Wan's are 13% smaller, HunyuanVideo 1.5's half)."""
    config = config_for(tiny_model_factory(family, task=task), family)
    config = config.model_copy(update={"model": config.model.model_copy(update={"dtype": "bfloat16", "task": task})})
    gpu, cpu = _plans_in_a_fresh_process(config, ("cuda", "cpu"), tmp_path)
    for bucket, sizes in gpu["activations"].items():
        assert sizes["none"] < 0.95 * cpu["activations"][bucket]["none"], (bucket, sizes, cpu["activations"][bucket])
    assert gpu["validation"] > 0


def _plans_in_a_fresh_process(config, devices: tuple[str, ...], folder: Path) -> list[dict]:
    """make_plan for each device in one process of its own, as the trainer's start-up runs it (stage 1 left out,
    only the step the config runs traced: train/parallel/layout.py): in this test process the HunyuanVideo 1.5 I2V
    activations once came out twice as large after other tests (a state this process's earlier tests leave, not
    found yet), so the plans are measured where no test ran before: forked from the warm interpreter of
    tests/helpers/forkserver.py, which imported the libraries and ran nothing (tests/helpers/plan_worker.py)."""
    from vt.shared.config import to_toml

    from helpers import HELPERS
    from helpers.cli_runs import run_forked

    (folder / "plan.toml").write_text(to_toml(config))
    out = folder / "plans.json"
    code, output = run_forked(
        str(HELPERS / "plan_worker.py"),
        str(folder / "plan.toml"),
        str(out),
        *devices,
        log=folder / "plan.log",
        timeout=600,
    )
    assert code == 0, output[-3000:]
    return json.loads(out.read_text())


def test_known_values_leave_a_large_product_of_small_masks_fake():
    """A mask's outer product at 8192 tokens is 67M booleans: an activation, traced fake (no memory, no
    compute), while the mask's own small ops still run for real."""
    from torch._subclasses.fake_tensor import FakeTensor

    from vt.shared.memory_trace import KnownValues

    with fake_mode(), KnownValues():
        mask = torch.ones(1, 8192, dtype=torch.bool)  # a small constant: made for real
        pairs = mask[:, :, None] & mask[:, None, :]
        kept = int(mask.sum())
    assert isinstance(pairs, FakeTensor) and pairs.shape == (1, 8192, 8192)
    assert kept == 8192


def test_ltx2_plans_a_run_that_trains_sound(tiny_model_factory):
    """model.audio: the traced step feeds the audio latents, their noise and the audio text, and holds more
    than the video-only step (the audio tokens and the cross-attention run with gradients)."""
    from vt.train.plan import make_plan

    model = tiny_model_factory("ltx-2")
    video = make_plan(config_for(model, "ltx-2", mode="full"), 1, "cpu")
    config = config_for(model, "ltx-2", mode="full")
    sound = make_plan(config.model_copy(update={"model": config.model.model_copy(update={"audio": True})}), 1, "cpu")
    ((name, steps),) = sound.activations.items()
    assert steps["none"] > video.activations[name]["none"] > 0


def test_what_fits_is_ordered_by_the_step_time_each_setting_costs(tiny_model_factory):
    """`vt-train plan --gpu-memory` lists what fits quickest first: the estimate counts checkpointing's recomputed
    forward from the fake step's FLOPs, the bytes offload and block swap move over PCIe (and the first swapped block,
    which no compute hides), and a second GPU halving each rank's micro-batch; the line names the rates it assumes."""
    from vt.train.plan import make_plan
    from vt.train.plan_search import alternatives, format_fits
    from vt.train.step_cost import Rates, by_step_time, step_seconds

    config = config_for(tiny_model_factory("wan"), "wan")
    base = make_plan(config, 1, "cpu")
    assert base.flops["checkpointing"] > 1.2 * base.flops["none"] > 0  # the blocks' forward, run twice
    options = alternatives(config, 1, "cpu")
    rows = {label: ratio for label, _, ratio in by_step_time(base, options)}
    assert rows["parallel.activation_checkpointing=true"] == pytest.approx(
        base.flops["checkpointing"] / base.flops["none"]
    )
    assert rows["2 GPUs (FSDP2)"] < 1.0 < rows["parallel.activation_checkpointing=true"]
    ordered = [ratio for _, _, ratio in by_step_time(base, options)]
    assert ordered == sorted(ordered)
    swap = dict(options)["block_swap.blocks_on_gpu=0"]
    swap.rank.swapped = 3 * 2**20  # two tiny blocks leave little to swap: what a real model's would move
    slow_bus = Rates(pcie=1.0)  # bytes moved dominate: the swapped weights in for the forward and the backward,
    assert step_seconds(swap, slow_bus) == pytest.approx(  # and the first block's, which nothing overlaps
        (2 * swap.rank.swapped + swap.rank.in_flight / 2) * config.train.grad_accum
    )
    fast_bus = Rates(pcie=float("inf"))  # nothing to wait for: a swap run computes as a checkpointed one
    assert step_seconds(swap, fast_bus) == pytest.approx(
        step_seconds(dict(options)["parallel.activation_checkpointing=true"], fast_bus)
    )
    lines = format_fits(base, alternatives(config, 1, "cpu", budget=100 * 2**30), 100.0, None)
    assert lines[0].startswith("what fits 100 GiB, quickest first") and "TFLOPS" in lines[0]
    assert "x" in lines[1] and "GiB host" in lines[1]


def test_a_token_budget_plans_each_bucket_at_its_own_micro_batch(tiny_model_factory):
    """token_budget.tokens_per_batch: Wan's 9x64x64 (48 tokens a sample) takes 4 samples of a 192-token budget, 9x64x128
    (96) takes 2; the plan traces each bucket at its own batch (the small bucket's activations grow, the wide one's
    stay as at batch_size 2) and prints both."""
    from vt.train.plan import format_plan, make_plan

    def plan(**sections):
        config = build(
            Config,
            {
                "model": {"family": "wan", "path": str(tiny_model_factory("wan")), "max_text_tokens": 16},
                "buckets": {"sizes": ["9x64x64", "9x64x128"]},
                "train": {"batch_size": 2},
                **sections,
            },
        )
        return make_plan(config, 1, "cpu", stage1=False)

    fixed, budget = plan(), plan(token_budget={"tokens_per_batch": 192})
    assert fixed.micro_batches == {"9x64x64": 2, "9x64x128": 2}
    assert budget.micro_batches == {"9x64x64": 4, "9x64x128": 2} and budget.micro_batch == 4
    assert budget.activations["9x64x64"]["none"] > fixed.activations["9x64x64"]["none"]
    assert budget.activations["9x64x128"]["none"] == fixed.activations["9x64x128"]["none"]
    assert "micro-batches per rank 9x64x64 4, 9x64x128 2" in format_plan(budget, None)


def test_what_is_live_is_what_is_counted(tiny_model_factory):
    """The validation pipeline's parts are in host memory between validations (train/validation.py `parts_to`) and on
    the device only in the validation phase; the EMA's swap-in keeps the trained weights beside the average while it
    renders; a guided step also runs the base's forward, whose prediction stays through the step's."""
    from vt.train.plan import make_plan

    model = tiny_model_factory("wan")
    plain = make_plan(config_for(model, "wan"), 1, "cuda", stage1=False)
    rank = plain.rank
    assert rank.validation_host == plain.validation["frozen"] > 0
    assert rank.resident == rank.weights + rank.optimizer + rank.buffers  # the parts are not resident
    assert rank.device_total == max(rank.startup, rank.resident + max(rank.training, rank.validating))
    ema = make_plan(config_for(model, "wan", ema={"decay": 0.9, "validation": True}), 1, "cuda", stage1=False)
    assert ema.rank.validation == rank.validation + rank.gradients  # the trained weights' float32 copy
    guided = make_plan(config_for(model, "wan", guidance={"scale": 3.0}), 1, "cuda", stage1=False)
    assert guided.activations != plain.activations  # the guided step's own trace
    bucket = next(iter(plain.activations))
    assert guided.activations[bucket]["none"] > plain.activations[bucket]["none"]


def test_one_step_trace_measures_what_the_three_modes_stacked_measure():
    """StepTrace (the plan's one mode) against KnownValues, PeakLive and FlopCount stacked as the plan stacked them: the
    same peak, live bytes and FLOPs over a forward and backward that reads a mask's values and indexes by it."""
    from vt.shared.memory_trace import FlopCount, KnownValues, StepTrace

    def step(*modes):
        with fake_mode():
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
            x = torch.zeros(512, 64, requires_grad=True)
            with contextlib.ExitStack() as stack:
                entered = [stack.enter_context(mode) for mode in modes]
                mask = torch.ones(512, dtype=torch.bool)  # a small constant: real, its values known
                kept = int(mask.sum())
                y = model(x)[mask]
                (y.float() ** 2).mean().backward()
        return entered, kept

    (merged,), kept = step(StepTrace())
    (_, stacked_peak, flops), stacked_kept = step(KnownValues(), PeakLive(), FlopCount())
    assert kept == stacked_kept == 512
    assert (merged.peak, merged.live, merged.total) == (stacked_peak.peak, stacked_peak.live, flops.total)
    assert merged.peak > 512 * 256 * 4 and merged.total == 3 * 2 * 512 * (64 * 256 + 256 * 64)  # forward + backward
