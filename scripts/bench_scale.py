"""Bytes a data-parallel trainer rank reads per step at 1, 2, 4 and 8 ranks (issue 17: ~1/D).

The demo clips are precomputed once (the real `vt-precompute run`), then re-encoded into a window whose
every global batch is full and divides by D (scripts/scale_window.py: 16 samples of the demo's most
common bucket in 4 shards of 4, read at global batch 8: 2 optimizer steps). At each world size D the
real `vt-train` runs under torchrun (gloo, DDP over D ranks) through tests/helpers/counting_worker.py,
which counts every storage request per rank. Rows: the largest rank's bytes read of the shards per step,
against one process's (ratio ~1/D), and the same less headers and caption tables against 1/D of the
global batch's bytes (the shards' own numbers). Headers (one per shard a rank touches) and caption tables
are what stays above 1/D: each rank that touches a shard reads them whole.

    python scripts/bench_scale.py [--worlds 1 2 4 8] [--out runs/bench]

`make bench` runs it after scripts/bench.py's own rows (its table and raw numbers go to <out>/scale.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_common import (
    BIN,
    ROOT,
    Row,
    asset_arguments,
    format_table,
    machine,
    run_timed,
    toml_string,  # noqa: E402
    write_run_config,
)


def train_overrides(model: Path, run_dir: Path, window: Path, batch: int, world: int) -> list[str]:
    """One epoch over the even window at global batch `batch`, DDP over `world` ranks, no validation."""
    return [
        f"model.path={toml_string(model)}",
        f"run.dir={toml_string(run_dir)}",
        f"window.uri={toml_string(f'counted://{window}')}",
        'window.size="keep"',
        f"train.batch_size={batch}",
        "train.epochs=1",
        "train.max_steps=0",
        "train.checkpoint_every=0",
        "validation.prompts=[]",
        "log.progress=false",
        f"parallel.dp_replicate={world}",
        "parallel.dp_shard=1",
    ]


def measure(args: argparse.Namespace, work: Path, window: Path, world: int) -> dict:
    """One counted run at `world` ranks: each rank's counts."""
    from scale_window import COUNTING_WORKER, read_counts

    run_dir = work / f"train-{world}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = write_run_config(
        args.config, work / f"train-{world}.toml", train_overrides(args.model, run_dir, window, args.batch, world)
    )
    counts = work / f"counts-{world}"
    os.environ["VT_STORAGE_COUNTS"] = str(counts)  # run_timed's child environment starts from this one
    _, seconds, _ = run_timed(
        [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={world}", str(COUNTING_WORKER), "run", str(config)],
        work / f"train-{world}.log",
        args.threads,
        timeout=600,
    )
    steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    return {"seconds": seconds, "steps": steps, "ranks": read_counts(counts, world)}


def rows_for(per_world: dict[int, dict], run) -> list[Row]:
    from scale_window import rank_row

    rows, one = [], None
    for world, result in sorted(per_world.items()):
        steps = result["steps"]
        ranks = [rank_row(c, run.rank_reads(r, world)) for r, c in enumerate(result["ranks"])]
        worst = max(ranks, key=lambda row: row["data_bytes"])
        per_step = worst["data_bytes"] / steps
        one = per_step if world == 1 else one
        rows.append(
            Row(
                f"bytes read per rank per step, {world} rank{'s' * (world > 1)}",
                per_step,
                "B",
                baseline=one,
                note=f"largest rank; 1/D = {1 / world:.3f}; of it headers "
                f"{worst['header_bytes'] / steps:,.0f} B ({worst['header_requests']} over the run, one per "
                f"shard touched) and caption tables {worst['table_bytes'] / steps:,.0f} B; "
                f"{worst['data_requests'] / steps:.1f} requests per step",
            )
        )
        rows.append(
            Row(
                f"  rows and captions per rank per step vs 1/D of the batch, {world}",
                max(r["rows_bytes"] for r in ranks) / steps,
                "B",
                baseline=run.global_bytes / world / steps,
            )
        )
    return rows


# A Wan 2.1 480p sample as the window holds it: 81 frames -> 21 x 60 x 104 latents of 16 channels, bf16
# (4.2 MB), and umT5's 512 x 4096 text rows, bf16, of which a caption keeps its tokens (caption_table.py)
REAL_LATENTS, REAL_TEXT = (16, 21, 60, 104), (512, 4096)


def real_size_rows(work: Path, worlds: list[int], batch: int = 8, shards: int = 4, per_shard: int = 8) -> list[Row]:
    """Bytes per rank per step at a real sample size, the trainer's reader alone (no model: a real transformer
    does not train on this machine). A window of `shards` x `per_shard` Wan 2.1 480p-size samples (random
    latents, a distinct caption each of 60-250 tokens); for each D every rank's reader (train/data.py, rank r of
    D) plans and loads every batch, each storage byte counted. Headers stay a small share here, so the rows
    show what the tiny-model rows above cannot: ~1/D."""
    import torch

    from vt.shared.caption_table import Captions
    from vt.shared.shards import encode_shard
    from vt.shared.window import open_reader, open_writer
    from vt.train.data import BatchReader

    uri = work / "real-size-window"
    shutil.rmtree(uri, ignore_errors=True)
    window = open_writer(str(uri), size="keep")
    window.register_producer(0, 1)
    generator = torch.Generator().manual_seed(0)
    for seq in range(shards):
        keys = [f"s{seq}-{i}" for i in range(per_shard)]
        latents = torch.randn(per_shard, *REAL_LATENTS, generator=generator).to(torch.bfloat16)
        text = torch.zeros(per_shard, *REAL_TEXT, dtype=torch.bfloat16)
        for i in range(per_shard):
            tokens = int(torch.randint(60, 250, (1,), generator=generator))
            text[i, :tokens] = torch.randn(tokens, REAL_TEXT[1], generator=generator).to(torch.bfloat16)
        captions = Captions({"prompt_embeds": text}, list(range(per_shard)))
        window.commit(
            0,
            seq,
            0,
            encode_shard({"latents": latents}, keys, {"bucket": "81x480x832"}, captions),
            "81x480x832",
            keys,
            "fp",
        )
    window.finish_producer(0, shards)
    steps = shards * per_shard // batch
    rows, one = [], None
    for world in sorted(worlds):
        per_rank = []
        for rank in range(world):
            counted = open_reader(str(uri))
            read_ranges, got = counted.storage.read_ranges, [0, 0]

            def counting(rel, ranges, read_ranges=read_ranges, got=got):
                data = read_ranges(rel, ranges)
                got[0] += sum(len(d) for d in data)
                got[1] += len(ranges)
                return data

            counted.storage.read_ranges = counting
            reader = BatchReader(counted, batch, on_read=lambda position: None, dp_rank=rank, dp_size=world)
            for _ in reader:
                pass
            per_rank.append(tuple(got))
        worst, requests = max(per_rank)
        per_step = worst / steps
        one = per_step if world == 1 else one
        rows.append(
            Row(
                f"bytes read per rank per step, Wan 480p-size samples, {world} rank{'s' * (world > 1)}",
                per_step / 2**20,
                "MiB",
                baseline=one / 2**20,
                note=f"the reader alone; largest rank; 1/D = {1 / world:.3f}; {requests / steps:.1f} "
                f"requests per step; {shards} shards of {per_shard}, global batch {batch}",
            )
        )
    shutil.rmtree(uri, ignore_errors=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    asset_arguments(parser, ROOT / "runs/bench", "scale.json and work/scale go here")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8], help="world sizes (1 is the baseline)")
    parser.add_argument("--samples", type=int, default=16, help="samples in the even window")
    parser.add_argument("--per-shard", type=int, default=4, help="samples per shard of the even window")
    parser.add_argument("--batch", type=int, default=8, help="global batch (every world size must divide it)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    if 1 not in args.worlds:
        parser.error("--worlds must include 1: every row compares with one process")
    if args.samples % args.batch or args.samples % args.per_shard or any(args.batch % w for w in args.worlds):
        parser.error("--samples must fill whole batches and shards, and every world size divide --batch")
    return args


def main(argv: list[str] | None = None) -> int:
    from bench_precompute import run_precompute
    from scale_window import regroup, run_bytes

    args = parse_args(argv)
    work = args.out / "work" / "scale"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    print(f"[bench_scale {time.perf_counter() - started:6.1f}s] precompute the demo clips", flush=True)
    source = Path(run_precompute(args.config, args.model, args.raw, work, "source", args.threads)["window"])
    window = work / "window"
    regroup(source, window, args.samples, args.per_shard)
    run = run_bytes(window, args.batch)
    per_world = {}
    for world in sorted(set(args.worlds)):
        print(f"[bench_scale {time.perf_counter() - started:6.1f}s] vt-train at {world} rank(s)", flush=True)
        per_world[world] = measure(args, work, window, world)
    rows = rows_for(per_world, run)
    print(f"[bench_scale {time.perf_counter() - started:6.1f}s] the reader alone on Wan 480p-size samples", flush=True)
    rows += real_size_rows(work, sorted(set(args.worlds)), args.batch)
    table = format_table(rows)
    captions = sorted({len(shard.caption_bytes) for shard in run.shards})
    print(
        f"\nBytes read per trainer rank ({args.samples} samples in shards of {args.per_shard}, global batch "
        f"{args.batch}, {len(run.batches)} steps; a sample's rows and caption "
        f"{run.global_bytes / args.samples:,.0f} B on average, a shard's header {run.shards[0].header:,} B; "
        f"{'-'.join(map(str, captions))} distinct caption(s) per shard: a rank reads a caption once per shard, "
        "so one process reads a shared caption once where D ranks read it once each)\n"
    )
    print(table)
    for row in rows:
        if row.note:
            print(f"  {row.name}: {row.note}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(
        json.dumps(
            {
                "machine": machine(),
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "global_bytes": run.global_bytes,
                "per_world": per_world,
                "rows": [r.to_dict() for r in rows],
                "table": table,
                "seconds": round(time.perf_counter() - started, 1),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
