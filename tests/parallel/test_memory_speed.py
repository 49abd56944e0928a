"""Memory and speed options on the CPU: fp8 base weights, attention backends, fp8 training's refusal,
FSDP2 CPU offload, and `accelerate launch` starting the trainer as torchrun does.

The runs reuse the session's precomputed Wan window (conftest `run_config`, LoRA, 4 steps of batch 4)
and its single-process reference, so the multi-process run costs only its own processes.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from vt.shared.config import load_config
from vt.train.trackers import read_metrics
from vt.train.trainer import Trainer

from helpers.dist_runs import BIN, assert_same_training, child_env, finish, free_port, single


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]


def block_bytes(trainer: Trainer) -> int:
    """Bytes of the blocks' frozen linear weights as stored (the large matmuls: nearly all of a real model)."""
    blocks = trainer.spec.blocks(trainer.transformer)
    linears = [m for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
    return sum(
        p.numel() * p.element_size() for m in linears for p in m.parameters(recurse=False) if not p.requires_grad
    )


def test_lora_on_fp8_base_weights_trains_like_the_bf16_base(tmp_path, run_config, caplog):
    """Same window, same seed, bf16 compute (autocast): a bf16-stored base and an fp8-stored base give
    losses within 0.5% at every step (measured here: 0.03%), the blocks' frozen linear weights take
    half the bytes of bf16, the adapters stay fp32, and the log says so. (The window's fp32 model is
    cast to bf16 for the reference, as `model.dtype` would load it; setting that key would change the
    window's provenance.)"""
    trainers, runs = {}, {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        config = run_config(tmp_path, "wan", name)
        cfg = load_config(
            config,
            [
                'train.mixed_precision="bf16"',
                f"frozen_base.fp8={str(fp8).lower()}",
                'train.attention_backend="native_math"',
            ],
        )
        trainers[name] = Trainer(cfg)
        if not fp8:
            for p in trainers[name].transformer.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        runs[name] = trainers[name].run()
    bf16, fp8 = trainers["bf16"], trainers["fp8"]
    assert block_bytes(fp8) * 2 == block_bytes(bf16)
    assert {p.dtype for p in fp8.params} == {torch.float32}, "LoRA adapters (and so AdamW state) stay fp32"
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.transformer.parameters())
    expected, got = losses(tmp_path / "bf16"), losses(tmp_path / "fp8")
    assert len(got) == len(expected) == 4
    assert got == pytest.approx(expected, rel=5e-3)
    assert got != expected, "fp8 storage must actually change the weights the base computes with"
    assert runs["fp8"]["steps"] == 4
    text = caplog.text
    assert "frozen transformer stored in float8_e4m3fn, computed in bfloat16" in text
    assert "attention backend native_math (diffusers dispatcher, 4 attention modules)" in text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ['train.attention_backend="native_flash"'],
            "train.attention_backend = 'native_flash' cannot run here: needs a CUDA GPU of sm80+",
        ),
        (['train.attention_backend="flex"'], "This machine can run: native, native_math"),
        (['validation.attention_backend="sage"'], "sageattention"),
        (['train.mode="full"', 'fp8_training.recipe="rowwise"'], "float8 training needs a CUDA GPU of sm89+"),
        (['fp8_training.recipe="tensorwise"'], "is for full fine-tuning"),
        (['train.mode="full"', "frozen_base.fp8=true"], "use fp8_training.recipe"),
    ],
    ids=["native-flash", "flex-backward", "sage", "fp8-cpu", "fp8-lora", "fp8-base-full"],
)
def test_what_this_machine_cannot_run_stops_the_run_at_start_up(tmp_path, run_config, overrides, message):
    config = load_config(run_config(tmp_path, "wan", "refused"), overrides)
    with pytest.raises(ValueError, match="^.*" + message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        Trainer(config)
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_accelerate_launch_runs_two_ranks_like_torchrun_with_cpu_offload(tmp_path, run_config, reference):
    """`accelerate launch --multi_gpu --num_processes 2 -m vt.train run ...` (its torchrun path, fine on
    CPUs) starts two ranks that train the single-process job exactly, here with FSDP2 CPU offload on."""
    config = run_config(tmp_path, "wan", "accelerate")
    log = tmp_path / "run.log"
    args = [
        str(BIN / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "vt.train",
        "run",
        str(config),
        "--set",
        "parallel.cpu_offload=true",
    ]
    finish(subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=child_env()), log)

    text = log.read_text()
    assert "dp_shard 2 x cp 1 x tp 1 (FSDP2), CPU offload" in text
    assert sorted(p.name for p in (tmp_path / "accelerate" / "samples").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    assert_same_training(tmp_path / "accelerate", reference("wan"))


def test_cpu_offload_in_one_process_shards_over_a_group_of_one(tmp_path, run_config, reference):
    """One GPU, a model larger than it: `parallel.cpu_offload` in a plain `vt-train run` joins a process
    group of one and trains under FSDP2's CPU offload exactly as the single-process job does without it."""
    config = run_config(tmp_path, "wan", "offload")
    log = tmp_path / "run.log"
    finish(single(config, "parallel.cpu_offload=true", log=log), log)
    assert "world 1 = dp_replicate 1 x dp_shard 1 x cp 1 x tp 1 (FSDP2), CPU offload" in log.read_text()
    assert_same_training(tmp_path / "offload", reference("wan"))


def test_accelerate_cpu_mode_warns_that_it_started_one_process(monkeypatch, caplog):
    """`accelerate launch --cpu --num_processes 2` runs one process without WORLD_SIZE: vt says how to get 2."""
    from vt.train.cli import _note_accelerate_cpu

    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _note_accelerate_cpu()
    assert "accelerate launch --multi_gpu --num_processes N -m vt.train run" in caplog.text
    caplog.clear()
    monkeypatch.setenv("WORLD_SIZE", "2")  # started as several ranks: nothing to say
    _note_accelerate_cpu()
    assert caplog.text == ""


def test_fp8_training_layers_compose_with_checkpointing_and_fsdp2_float8_all_gather(tmp_path):
    """The trainer refuses fp8 training on CPUs (no fast float8 matmuls), but torchao emulates them,
    so the composition itself runs here: float8 linears chosen by a filter, then activation
    checkpointing, then FSDP2 (one rank) with float8 all-gather and the scales precomputed after each
    step, training two steps to within 5% of the same model in bf16."""
    import torch.distributed as dist
    from bench_parallel import build_wan
    from torch.distributed.device_mesh import init_device_mesh

    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec
    from vt.train.fp8 import after_optimizer_step, apply_fp8_training
    from vt.train.parallel import apply_ac, apply_fsdp

    spec = build_spec(ModelConfig(family="wan"), frame_rate=16.0)
    inputs = (torch.randn(1, 16, 2, 8, 8), torch.tensor([500.0]), torch.randn(1, 8, 64))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        losses = {}
        for recipe in ("none", "tensorwise"):
            model = build_wan(2, 2, 32, 128, 64)
            if recipe != "none":
                chosen = apply_fp8_training(
                    model, recipe, fsdp=True, module_filter=lambda m, name: name.startswith("blocks.")
                )
                assert len(chosen) == 20  # 2 blocks x (4 self + 4 cross attention + 2 FFN) linears
            apply_ac(model, spec)
            apply_fsdp(model, spec, mesh, param_dtype=torch.bfloat16)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(*inputs).sample.float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if recipe != "none":
                    after_optimizer_step(model, recipe, fsdp=True)
            losses[recipe] = float(loss.detach())
    finally:
        dist.destroy_process_group()
    assert losses["tensorwise"] == pytest.approx(losses["none"], rel=0.05)
    assert losses["tensorwise"] != losses["none"]


def test_sharded_fp8_storage_picks_the_layers_diffusers_hooks_pick():
    """Under FSDP2 the frozen weights are cast in place (no hooks); the layers must be the ones
    diffusers' layerwise casting stores in fp8, and the model's `.dtype` (what vt feeds it) unchanged."""
    from diffusers import LTXVideoTransformer3DModel

    from vt.train.fp8 import store_base_fp8

    def ltx():
        return LTXVideoTransformer3DModel(
            in_channels=16,
            out_channels=16,
            num_attention_heads=2,
            attention_head_dim=16,
            cross_attention_dim=32,
            num_layers=1,
            caption_channels=32,
        )

    hooked, sharded = ltx(), ltx()
    store_base_fp8(hooked, torch.float32, sharded=False)
    store_base_fp8(sharded, torch.float32, sharded=True)
    fp8 = {name for name, p in sharded.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert fp8 == {name for name, p in hooked.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert "transformer_blocks.0.attn1.to_q.weight" in fp8 and "proj_in.weight" not in fp8
    assert sharded.dtype == torch.float32
