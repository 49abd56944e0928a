"""Memory and speed on one GPU, as vt trains: one table of tokens/s, MFU and peak memory.

Three groups of rows, each a fresh model trained for one warm-up and `--steps` timed steps through
the Model Spec's forward (flow-matching loss, AdamW), in one process on one GPU:

- full: a Wan 2.1 1.3B-shaped transformer (30 layers, 12 x 128 heads, FFN 8960, text 4096), fp32
  master weights under bf16 autocast, on an 81x480x832 clip (21 x 60 x 104 latents -> 32,760
  tokens after the 2x2 patch) and 512 text tokens: one row per attention backend this machine can
  train with (activation checkpointing on), then the default backend without checkpointing and
  with torch.compile per block.
- fp8: 14B-shaped layer widths (5120 wide, 40 x 128 heads, FFN 13824; `--fp8-layers` blocks) at the
  same clip, full fine-tuning in bf16 against torchao float8 tensorwise and rowwise (compiled
  blocks: torchao's float8 casts need compile to pay off), on the layers torchao's filter picks.
- lora: the 1.3B shape with rank-32 LoRA on a bf16 base against an fp8 e4m3 base (vt's
  `frozen_base.fp8`): memory and step time.
- plan: a rank-32 LoRA on a Wan 2.1 14B-shaped transformer (all 40 blocks, random bf16 weights) at the
  same clip, activation checkpointing on, its peak GPU memory over the training steps next to what
  `vt-train plan` estimates for that run from the real configs (scripts/real_models.json).

- run: `vt-train run` itself under torchrun on every GPU here, at real size from random-weight real
  configs, start-up to validation and export: a Wan 2.1 14B LoRA at 81x480x832 and a HunyuanVideo 1.5
  LoRA at 121x480x848, each with its measured peak beside the plan's, step time and MFU, and the Wan 2.1 14B
  LoRA again on one GPU capped at 24 GiB (torch.cuda.set_per_process_memory_fraction) with the settings
  docs/memory.md names for a 24 GB card, block swap (10 blocks resident) and activation offload, then an NF4 base
  with activation offload, each row with its start-up peak, page-locked and peak host memory beside the plan's
  and its step time (against the uncapped row's: what the copies cost)
  (scripts/gpu_real_run.py; ~75 GB of disk for the random weights, freed once no later row uses them).

MFU counts model FLOPs (forward + backward = 3 x forward; recomputation not counted) against the
GPU's dense bf16 peak (H100/H200: 989 TFLOP/s), also for the fp8 rows; LoRA rows show none. A row
that runs out of memory or cannot run here says so and the table goes on.

    scripts/gpu_check.sh                 # one GPU, real sizes (estimated 6-8 min on an H200)
    scripts/gpu_check.sh --dry           # CPU, tiny shapes, one step: proves every row's path runs
    scripts/gpu_check.sh --only full     # one group (full, fp8, lora, plan, run)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
GROUPS = ("full", "fp8", "lora", "plan", "run")


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_dim: int
    ffn: int
    text_dim: int = 4096
    text_len: int = 512
    frames: int = 21  # latent frames (81 video frames)
    height: int = 60  # latent height (480 px)
    width: int = 104  # latent width (832 px)

    @property
    def tokens(self) -> int:
        return self.frames * (self.height // 2) * (self.width // 2)


WAN_1_3B = Shape(layers=30, heads=12, head_dim=128, ffn=8960)
WAN_14B = Shape(layers=4, heads=40, head_dim=128, ffn=13824)
DRY = dict(text_dim=64, text_len=16, frames=1, height=8, width=8)  # tiny clip, 16 video tokens


@dataclass(frozen=True)
class Case:
    group: str
    shape: Shape
    backend: str = "native"
    ac: bool = True
    compile: bool = False
    fp8: str = "none"  # full fine-tuning: "tensorwise" / "rowwise"
    lora_base: str = ""  # LoRA rows: "bf16" or "fp8"

    @property
    def label(self) -> str:
        parts = [self.group, self.backend, "AC" if self.ac else "no AC"]
        if self.compile:
            parts.append("compile")
        if self.fp8 != "none" or self.group == "fp8":
            parts.append(f"fp8 {self.fp8}" if self.fp8 != "none" else "bf16")
        if self.lora_base:
            parts.append(f"{self.lora_base} base")
        return ", ".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU dry run: tiny shapes, one step per row, no compile")
    parser.add_argument("--only", choices=GROUPS, action="append", help="run only these groups (repeatable)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--fp8-layers", type=int, default=4, help="blocks of the 14B-shaped model")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak per GPU (0: look it up)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu_check"), help="the run rows' models and runs")
    args = parser.parse_args(argv)
    if args.dry:
        args.steps = 1
    return args


def cases(args, training_backends: list[str]) -> list[Case]:
    """The rows to run, in order; tiny shapes and no compile in a dry run."""
    big, wide = WAN_1_3B, replace(WAN_14B, layers=args.fp8_layers)
    if args.dry:
        big = Shape(layers=1, heads=2, head_dim=32, ffn=128, **DRY)
        wide = Shape(layers=1, heads=2, head_dim=32, ffn=128, **DRY)
    compile_ok = not args.dry
    # native_math materialises every 32k x 32k score matrix: a dry-run row only. flex is fused only
    # when compiled (eager flex is the same materialising fallback), so its row compiles.
    full = [
        Case("full", big, backend=b, compile=b == "flex" and compile_ok)
        for b in training_backends
        if args.dry or b != "native_math"
    ]
    full += [Case("full", big, ac=False)] + ([Case("full", big, compile=True)] if compile_ok else [])
    fp8 = [Case("fp8", wide, compile=compile_ok, fp8=recipe) for recipe in ("none", "tensorwise", "rowwise")]
    lora = [Case("lora", big, lora_base=base) for base in ("bf16", "fp8")]
    planned = [Case("plan", wide if args.dry else replace(WAN_14B, layers=40), lora_base="bf16")]
    chosen = args.only or GROUPS
    return [case for case in full + fp8 + lora + planned if case.group in chosen]


def model_flops_per_sample(shape: Shape) -> float:
    """Forward + backward matmul FLOPs of one sample (3 x forward; recomputation not counted)."""
    d, f, s, t = shape.heads * shape.head_dim, shape.ffn, shape.tokens, shape.text_len
    per_layer = (
        2 * s * (6 * d * d + 2 * d * f)  # self-attn q,k,v,o + cross-attn q,o + FFN, on video tokens
        + 2 * t * 2 * d * d  # cross-attn k, v on text tokens
        + 4 * s * s * d
        + 4 * s * t * d
    )  # attention scores and weighted sums (self, cross)
    embed = 2 * t * (shape.text_dim * d + d * d) + 2 * s * (16 * 4 * d + d * 16 * 4)  # text embedder, patch in/out
    return 3.0 * (shape.layers * per_layer + embed)


def peak_tflops(args, device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def build(case: Case, args, device):
    """The case's model on `device` and the parameters AdamW trains."""
    import torch
    from bench_parallel import build_wan

    from vt.train.attention import set_backend
    from vt.train.fp8 import apply_fp8_training, store_base_fp8
    from vt.train.parallel import apply_ac, apply_compile

    shape = case.shape
    with torch.device(device):  # random init straight on the device: seconds, not minutes
        model = build_wan(shape.layers, shape.heads, shape.head_dim, shape.ffn, shape.text_dim)
    if case.lora_base:
        from peft import LoraConfig

        model.requires_grad_(False).to(torch.bfloat16)
        if case.lora_base == "fp8":
            store_base_fp8(model, torch.bfloat16, sharded=False)
        model.add_adapter(
            LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
        )
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    set_backend(model, case.backend)
    if case.fp8 != "none":
        dry_filter = (lambda m, name: m.in_features % 16 == 0 and m.out_features % 16 == 0) if args.dry else None
        apply_fp8_training(model, case.fp8, fsdp=False, module_filter=dry_filter)
    spec = _spec()
    if case.ac:
        apply_ac(model, spec)
    if case.compile:
        apply_compile(model, spec)
    return model, [p for p in model.parameters() if p.requires_grad]


def _spec():
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    return build_spec(ModelConfig(family="wan"), frame_rate=16.0)


def measure(case: Case, args, device) -> dict:
    """Train the case for a warm-up and `args.steps` steps; its row (or why it has none)."""
    import torch
    from bench_parallel import wan_batch

    from vt.train.data import Batch
    from vt.train.objectives import flow_matching_loss
    from vt.train.parallel.batching import draw_inputs, take_slice

    row = {"case": case.label, **{k: v for k, v in asdict(case).items() if k != "shape"}}
    model = optimizer = None
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model, params = build(case, args, device)
        if case.group == "plan" and device.type == "cuda":  # the run's memory, not the random init's
            torch.cuda.reset_peak_memory_stats(device)
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        shape, spec = case.shape, _spec()
        tensors = wan_batch(1, shape.frames, shape.height, shape.width, shape.text_len, shape.text_dim)
        part = take_slice(Batch("check", 0, ["0"], tensors), 0, 1)
        sigmas, noise = draw_inputs(part, 0, 0, "logit_normal", 3.0)
        batch = {k: v.to(device) for k, v in part.tensors.items()}
        sigmas, noise = sigmas.to(device), noise.to(device)
        times, losses = [], []
        warmup = 0 if args.dry else 1  # a dry run proves the path; its one step is not a measurement
        for step in range(warmup + args.steps):
            _sync(device)
            begin = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = flow_matching_loss(spec.forward(model, batch, sigmas, noise)).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            if step >= warmup:
                times.append(time.perf_counter() - begin)
            losses.append(float(loss.detach()))
        step_s = statistics.median(times)
        peak = peak_tflops(args, device)
        flops = model_flops_per_sample(shape) / step_s
        row.update(
            tokens=shape.tokens,
            step_ms=step_s * 1e3,
            tokens_s=shape.tokens / step_s,
            mfu=(flops / (peak * 1e12)) if peak and not case.lora_base else None,
            peak_gib=(torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
            losses=losses,
            note="" if all(map(math.isfinite, losses)) else "loss not finite",
        )
        if case.group == "plan":
            row["plan_gib"] = planned_gib(case, args)
            row["note"] = (row["note"] + f" plan {row['plan_gib']:.1f} GiB").strip()
    except torch.OutOfMemoryError:
        row["note"] = "out of memory"
    except (RuntimeError, ValueError, NotImplementedError) as err:  # a kernel this GPU or build lacks
        row["note"] = f"failed: {str(err).splitlines()[0][:90]}"
    finally:
        del model, optimizer
        gc.collect()
        if case.compile:
            torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def planned_gib(case: Case, args) -> float:
    """What `vt-train plan` gives for the plan row's run (GPU memory, one GPU, LoRA rank args.lora_rank):
    from the real Wan 2.1 14B configs, or the tiny preset's in a dry run."""
    import tempfile

    from vt.shared.config import Config
    from vt.shared.config import build as build_config
    from vt.train.plan import make_plan

    shape = case.shape
    with tempfile.TemporaryDirectory() as work:
        if args.dry:
            from make_tiny_model import make_tiny_model

            folder = make_tiny_model("wan", Path(work) / "wan", seed=0)
        else:
            from memory_table import config_only_model

            folder = config_only_model("wan2.1-14b", Path(work) / "wan")
        config = build_config(
            Config,
            {
                "model": {"family": "wan", "path": str(folder), "dtype": "bfloat16", "max_text_tokens": shape.text_len},
                "buckets": {"sizes": [f"{4 * (shape.frames - 1) + 1}x{8 * shape.height}x{8 * shape.width}"]},
                "train": {"mode": "lora", "batch_size": 1},
                "adapter": {
                    "rank": args.lora_rank,
                    "alpha": float(args.lora_rank),
                    "targets": ["to_q", "to_k", "to_v", "to_out.0"],
                },
                "parallel": {"activation_checkpointing": case.ac},
            },
        )
        return make_plan(config, 1, "cuda").rank.device_total / 2**30


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_rows(rows: list[dict]) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [
        "| case | tokens | step ms | tokens/s | MFU | peak GiB | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {num(r.get('tokens'), ',')} | {num(r.get('step_ms'), '.1f')} | "
            f"{num(r.get('tokens_s'), ',.0f')} | {num(r.get('mfu'), '.1%')} | "
            f"{num(r.get('peak_gib'), '.1f')} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, launch=None) -> int:
    """The table; `launch` starts the run rows' torchrun commands (gpu_real_run.run_rows; default: fresh processes)."""
    args = parse_args(argv)
    import torch

    from vt.train.attention import available_backends

    if not args.dry and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry for the CPU dry run", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry else torch.device("cuda", torch.cuda.current_device())
    backends = available_backends(device, training=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    started = time.perf_counter()
    rows = [measure(case, args, device) for case in cases(args, backends)]
    if "run" in (args.only or GROUPS):
        from gpu_real_run import run_rows

        rows += run_rows(args.dry, args.work, peak_tflops(args, device), launch=launch)
    print(
        f"vt gpu check on {name}: torch {torch.__version__}, attention backends {', '.join(backends)}, "
        f"peak {peak_tflops(args, device) or 'unknown'} TFLOP/s bf16, {args.steps} timed step(s) per row, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r.get("note") == "loss not finite" or r.get("note", "").startswith("vt-train exited")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
