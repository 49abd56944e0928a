"""One FSDP2 training step of a Wan 2.1 1.3B-shaped transformer in bf16: tokens/s and MFU.

Real sizes (30 layers, 12 heads x 128, FFN 8960, text 4096), random weights, a realistic clip
(81 frames at 480x832 -> 21 x 60 x 104 latents -> 32,760 tokens after the 2x2 patch) and 512 text
tokens. The model goes through vt's own strategies in the trainer's order (activation checkpointing
per block, optional compile, FSDP2 per block then root with bf16 parameters and fp32 reduction)
and the Model Spec's forward under bf16 autocast, exactly as `vt-train` runs it. One process per
GPU (scripts/gpu_check.sh starts them with torchrun); each rank trains `--batch` samples.

MFU counts model FLOPs (forward + backward = 3 x forward, recomputation not counted) per second per
GPU against the GPU's dense bf16 peak (H100/H200 989 TFLOPS, A100 312; others: --peak-tflops).

    scripts/gpu_check.sh                     # all GPUs of this machine
    scripts/gpu_check.sh --dry               # CPU, 1 layer, tiny clip: proves the path executes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=8960)
    parser.add_argument("--text-dim", type=int, default=4096)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames)")
    parser.add_argument("--height", type=int, default=60, help="latent height (480 px)")
    parser.add_argument("--width", type=int, default=104, help="latent width (832 px)")
    parser.add_argument("--batch", type=int, default=1, help="samples per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--no-ac", dest="ac", action="store_false", help="no activation checkpointing")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak per GPU (0: look it up)")
    parser.add_argument("--dry", action="store_true", help="CPU dry run: 1 layer, a tiny clip, 32 text tokens")
    args = parser.parse_args(argv)
    if args.dry:
        args.layers, args.frames, args.height, args.width, args.text_len, args.steps = 1, 1, 8, 8, 32, 1
    return args


def init_group(device_type: str) -> tuple[int, int]:
    """(rank, world) from torchrun's environment, or a one-process group (FSDP2 needs a mesh)."""
    import torch.distributed as dist

    from vt.shared import runtime

    rank, world = runtime.rank(), runtime.world_size()
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return rank, world


def model_flops_per_sample(args) -> float:
    """Forward + backward matmul FLOPs of one sample (3 x forward; recomputation not counted)."""
    d, f = args.heads * args.head_dim, args.ffn
    s = args.frames * (args.height // 2) * (args.width // 2)  # video tokens after the 1x2x2 patch
    t = args.text_len
    per_layer = (2 * s * (6 * d * d + 2 * d * f)  # self-attn q,k,v,o + cross-attn q,o + FFN, on video tokens
                 + 2 * t * 2 * d * d  # cross-attn k, v on text tokens
                 + 4 * s * s * d + 4 * s * t * d)  # attention scores and weighted sums (self, cross)
    embed = 2 * t * (args.text_dim * d + d * d) + 2 * s * (16 * 4 * d + d * 16 * 4)  # text embedder, patch in/out
    return 3.0 * (args.layers * per_layer + embed)


def peak_tflops(args, device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    name = __import__("torch").cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from bench_parallel import build_wan, wan_batch
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec
    from vt.train.objectives import flow_matching_loss
    from vt.train.parallel import apply_ac, apply_compile, apply_fsdp
    from vt.train.parallel.batching import draw_inputs, take_slice
    from vt.train.data import Batch
    from vt.train.parallel.dims import ParallelDims
    from vt.train.parallel.grads import clip_grad_norm

    if not args.dry and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry for the CPU dry run", file=sys.stderr)
        return 2
    from vt.shared.runtime import pick_device

    device = torch.device("cpu") if args.dry else pick_device("cuda")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = init_group(device.type)
    import torch.distributed as dist

    try:
        meshes = ParallelDims(dp_shard=world, world_size=world).build_mesh(device.type)
        spec = build_spec(ModelConfig(family="wan"), frame_rate=16.0)
        started = time.perf_counter()
        with torch.device(device):  # random init straight on the device: seconds, not minutes
            model = build_wan(args.layers, args.heads, args.head_dim, args.ffn, args.text_dim)
        n_params = sum(p.numel() for p in model.parameters())
        if args.ac:
            apply_ac(model, spec)
        if args.compile:
            apply_compile(model, spec)
        apply_fsdp(model, spec, meshes["dp_shard"], param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        built = time.perf_counter() - started

        tensors = wan_batch(args.batch, args.frames, args.height, args.width, args.text_len, args.text_dim, seed=rank)
        part = take_slice(Batch("check", 0, [str(i) for i in range(args.batch)], tensors), 0, 1)
        sigmas, noise = draw_inputs(part, 0, rank, "logit_normal", 3.0)
        batch = {k: v.to(device) for k, v in part.tensors.items()}
        sigmas, noise = sigmas.to(device), noise.to(device)
        times, losses = [], []
        for step in range(1 + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            begin = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = spec.forward(model, batch, sigmas, noise)
            loss = flow_matching_loss(out)
            loss.backward()
            norm = clip_grad_norm(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:
                times.append(time.perf_counter() - begin)
            losses.append(loss.item())
        step_s = statistics.median(times)
        tokens = args.batch * args.frames * (args.height // 2) * (args.width // 2)
        flops = model_flops_per_sample(args) * args.batch / step_s
        peak = peak_tflops(args, device)
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        finite = all(map(lambda v: v == v and abs(v) != float("inf"), losses)) and norm == norm
        if rank == 0:
            print(f"Wan 1.3B-shaped transformer: {n_params / 1e9:.3f}B parameters, {args.layers} layers, "
                  f"{args.heads}x{args.head_dim} heads, FFN {args.ffn}; FSDP2 over {world} rank(s), bf16 params, "
                  f"fp32 reduce, AC {'on' if args.ac else 'off'}, compile {'on' if args.compile else 'off'}; "
                  f"built in {built:.1f}s on {device}")
            print(f"clip {args.frames}x{args.height}x{args.width} latents = {tokens // args.batch} tokens/sample, "
                  f"{args.text_len} text tokens, {args.batch} sample(s)/rank; losses {['%.4f' % v for v in losses]}, "
                  f"grad norm {norm:.3f}")
            print(f"step time {step_s * 1e3:.1f} ms (median of {len(times)}); tokens/s {tokens * world / step_s:,.0f} "
                  f"(job), {tokens / step_s:,.0f} per rank; model TFLOP/s per rank {flops / 1e12:.1f}; "
                  f"MFU {f'{100 * flops / (peak * 1e12):.1f}%' if peak else 'n/a (unknown peak: --peak-tflops)'}; "
                  f"peak memory rank 0 {memory:.1f} GiB")
        if not finite:
            print(f"rank {rank}: loss or gradient norm is not finite: {losses}, {norm}", file=sys.stderr)
            return 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
