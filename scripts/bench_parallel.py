"""FSDP2 scaling on this machine: per-rank bytes of parameters, gradients and optimizer state, and
step time, at world sizes 1, 2 and 4 (gloo on the CPU, one process per rank, FileStore group).

The model is a Wan 2.1 transformer of a bench size (full fine-tuning, AdamW), wrapped by vt's own
`parallelize` exactly as the trainer does: FSDP2 per block, then the root. The global batch is the
same at every world size, so each rank's slice shrinks as the world grows. Memory goal: each rank
holds at most 1.1 x (one process's bytes / N). Step time is printed against one process as
context, not a goal: on a machine with fewer cores than ranks the ranks share cores.

    python scripts/bench_parallel.py [--layers 4] [--heads 4] [--head-dim 64] [--worlds 1 2 4]

`make bench` runs it after scripts/bench.py's own rows (its table and raw numbers go to
<out>/parallel.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_common import ROOT, Row, format_table, machine  # noqa: E402

MEMORY_GOAL = 1.10  # per-rank bytes <= 1.1 x (one process's bytes / N)


def build_wan(layers: int, heads: int, head_dim: int, ffn: int, text_dim: int, seed: int = 0):
    """A Wan 2.1 transformer with random weights (real class, chosen sizes), fp32, training mode."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=text_dim,
            freq_dim=256,
            ffn_dim=ffn,
            num_layers=layers,
            cross_attn_norm=True,
            eps=1e-6,
            rope_max_seq_len=1024,
        )
    return model.train().requires_grad_(True)


def wan_batch(samples: int, frames: int, height: int, width: int, text_len: int, text_dim: int, seed: int = 1) -> dict:
    """Latents (B, 16, F, H, W) and text embeddings (B, L, D) drawn from a seeded generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(samples, 16, frames, height, width, generator=generator),
        "prompt_embeds": torch.randn(samples, text_len, text_dim, generator=generator),
    }


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def worker(rank: int, world: int, store: str, settings: dict, queue) -> None:
    import warnings

    os.environ.setdefault("VT_LOG_LEVEL", "WARNING")  # one table, not a layout line per rank
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    import torch
    import torch.distributed as dist

    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec
    from vt.train.data import Batch
    from vt.train.objectives import flow_matching_loss
    from vt.train.parallel import parallelize
    from vt.train.parallel.batching import draw_inputs, take_slice
    from vt.train.parallel.dims import ParallelDims
    from vt.train.parallel.grads import clip_grad_norm
    from vt.train.parallel.world import World

    torch.set_num_threads(settings["threads"])
    dims = ParallelDims(dp_shard=world, world_size=world)
    meshes = None
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        meshes = dims.build_mesh("cpu")
    try:
        spec = build_spec(ModelConfig(family="wan"), frame_rate=16.0)
        model = build_wan(
            settings["layers"], settings["heads"], settings["head_dim"], settings["ffn"], settings["text_dim"]
        )
        parallelize(model, spec, World(dims, rank, 0, torch.device("cpu"), meshes))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        tensors = wan_batch(
            settings["batch"],
            settings["frames"],
            settings["size"],
            settings["size"],
            settings["text_len"],
            settings["text_dim"],
        )
        batch = Batch("bench", 0, [f"s{i}" for i in range(settings["batch"])], tensors)
        part = take_slice(batch, dims.dp_rank(rank), dims.dp)
        sigmas, noise = draw_inputs(part, 0, 0, "logit_normal", 1.0)
        times, grads = [], 0
        for step in range(settings["warmup"] + settings["steps"]):
            started = time.perf_counter()
            out = spec.forward(model, part.tensors, sigmas, noise)
            (flow_matching_loss(out) * part.count * dims.dp / len(batch)).backward()
            grads = local_bytes(p.grad for p in params)
            clip_grad_norm(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= settings["warmup"]:
                times.append(time.perf_counter() - started)
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.ndim]
        queue.put(
            (
                rank,
                {
                    "params": local_bytes(params),
                    "grads": grads,
                    "optim": local_bytes(state),
                    "step_s": statistics.median(times),
                },
            )
        )
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure(world: int, settings: dict) -> list[dict]:
    """Run one world size; per-rank results in rank order."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            worker, args=(world, os.path.join(folder, "store"), settings, queue), nprocs=world, start_method="spawn"
        )
    results = dict(queue.get() for _ in range(world))
    return [results[r] for r in range(world)]


def rows_for(per_world: dict[int, list[dict]], settings: dict) -> list[Row]:
    one = per_world[1][0]
    rows = []
    for world, ranks in sorted(per_world.items()):
        if world == 1:
            continue
        for key, what in (("params", "parameters"), ("grads", "gradients"), ("optim", "optimizer state")):
            worst = max(r[key] for r in ranks)
            rows.append(
                Row(
                    f"FSDP2 {what} per rank, world {world}",
                    worst,
                    "B",
                    baseline=one[key] / world,
                    max_ratio=MEMORY_GOAL,
                    note=f"largest rank; one process holds {one[key]:,} B" if key == "params" else "",
                )
            )
        rows.append(
            Row(
                f"FSDP2 step time, world {world} vs 1 process",
                ranks[0]["step_s"] * 1e3,
                "ms",
                baseline=one["step_s"] * 1e3,
                note=f"global batch {settings['batch']}, {world} ranks on {os.cpu_count()} cores",
            )
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes (1 is the baseline)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--text-dim", type=int, default=64)
    parser.add_argument("--text-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="global batch (the same at every world size)")
    parser.add_argument("--frames", type=int, default=3, help="latent frames")
    parser.add_argument("--size", type=int, default=16, help="latent height and width")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 1 warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench", help="parallel.json goes here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a row misses its goal")
    args = parser.parse_args(argv)
    if 1 not in args.worlds:
        parser.error("--worlds must include 1: every row compares with one process")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("worlds", "out", "strict")}
    settings["warmup"] = 1
    started = time.perf_counter()
    per_world = {}
    for world in sorted(set(args.worlds)):
        print(f"[bench_parallel {time.perf_counter() - started:6.1f}s] FSDP2 at world size {world}", flush=True)
        per_world[world] = measure(world, settings)
    rows = rows_for(per_world, settings)
    table = format_table(rows)
    print(f"\nFSDP2 scaling (Wan {args.layers} layers, {args.heads}x{args.head_dim} heads, full fine-tune, AdamW)\n")
    print(table)
    for row in rows:
        if row.note:
            print(f"  {row.name}: {row.note}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel.json").write_text(
        json.dumps(
            {
                "machine": machine(),
                "settings": settings,
                "per_world": per_world,
                "rows": [r.to_dict() for r in rows],
                "table": table,
            },
            indent=1,
        )
    )
    failed = [r.name for r in rows if r.ok is False]
    if failed:
        print(f"over goal: {', '.join(failed)}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
