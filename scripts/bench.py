"""`make bench`: vt against plain baselines on the tiny LTX-Video demo, measured in one run.

1. precompute seconds per sample (the real `vt-precompute run` over the demo raw shards);
2. stored bytes per sample in the window against fp32 torch.save files, one per sample;
3. trainer step time against a bare PyTorch loop doing the same work (alternating rounds);
4. seconds from launching `vt-train run` to its first step, against a bare script's launch.
5. seconds from launch to vt-precompute's first decoded sample and to vt-train's first step, each
   against a bare `python -c "import torch, diffusers"` (scripts/bench_startup.py);
6. precompute samples/s in steady state against a naive one-at-a-time loop and against encoding
   alone (scripts/bench_precompute_throughput.py).
Then FSDP2 scaling (scripts/bench_parallel.py), the bytes each data-parallel trainer rank reads per
step at 1, 2, 4 and 8 ranks (scripts/bench_scale.py), stage 1 with one producer against two on one window
(scripts/bench_producers.py) and decode ms per clip at Wan 2.1's 480p and 720p buckets on one core
(scripts/bench_decode_cores.py), each with a table of its own.

Prints one table (benchmark, vt, baseline, ratio, goal, ok?) and writes it with every raw
measurement to <out>/results.json. Working files go to <out>/work and are replaced each run.
How to read the numbers: docs/benchmarks.md.

    python scripts/bench.py [--model runs/models/ltx-video-tiny] [--raw runs/data/raw] [--rounds 7]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_common import ROOT, asset_arguments, format_table, machine  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    asset_arguments(parser, ROOT / "runs/bench", "results.json and work/ go here")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds of the step bench")
    parser.add_argument(
        "--steps",
        type=int,
        default=7,
        help="optimizer steps per side per round (7: one pass over the demo window's batches)",
    )
    parser.add_argument("--launches", type=int, default=5, help="alternating launch pairs (vt-train, bare)")
    parser.add_argument("--precompute-runs", type=int, default=3, help="vt-precompute processes")
    parser.add_argument(
        "--startup-rounds",
        type=int,
        default=3,
        help="rounds of (bare import, vt-precompute, vt-train) processes for the start-up rows",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on both sides (0: torch's default); 1 is steadier on a shared CPU",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a row misses its goal")
    parser.add_argument("--heads", type=int, default=8, help="bench transformer: attention heads")
    parser.add_argument("--head-dim", type=int, default=64, help="bench transformer: head size")
    parser.add_argument("--layers", type=int, default=4, help="bench transformer: blocks")
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "launches", "precompute_runs", "startup_rounds", "heads", "head_dim", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    missing = [str(p) for p in (args.model / "model_index.json", args.raw) if not p.exists()]
    if missing:
        parser.error(
            f"missing {', '.join(missing)}: build the tiny model and raw shards with `make assets`, "
            "or pass --model and --raw"
        )
    if not sorted(args.raw.glob("*.tar")):
        parser.error(f"{args.raw} holds no .tar shards: rebuild them with `make assets`")
    return args


def run(args: argparse.Namespace) -> dict:
    import torch
    from bench_precompute import bench_precompute
    from bench_precompute_throughput import bench_throughput
    from bench_startup import bench_startup
    from bench_storage import bench_storage
    from bench_train import bench_launch, bench_steps, make_bench_transformer

    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    info = machine()
    started = time.perf_counter()

    def stage(text: str) -> None:
        print(f"[bench {time.perf_counter() - started:6.1f}s] {text}", flush=True)

    stage(f"precompute: {args.precompute_runs} x vt-precompute run over {args.raw}")
    pre = bench_precompute(args.config, args.model, args.raw, work, args.precompute_runs, args.threads)
    stage(f"storage: window of {pre['samples']} samples vs fp32 torch.save per sample")
    storage = bench_storage(pre["window"], work, pre["samples"])
    transformer = make_bench_transformer(args.model, work / "bench-transformer", args.heads, args.head_dim, args.layers)
    stage(f"train step: {args.rounds} alternating rounds x {args.steps} steps, Trainer.train_step vs bare loop")
    steps = bench_steps(args.config, args.model, transformer, pre["window"], work, args.rounds, args.steps)
    stage(f"launch: {args.launches} alternating vt-train run / bare script processes")
    launch = bench_launch(
        args.config,
        args.model,
        transformer,
        pre["window"],
        work,
        args.launches,
        max_steps=2 * args.steps + 2,
        threads=args.threads,
        batch_size=steps["batch_size"],
    )
    stage(f"start-up: {args.startup_rounds} rounds x bare import / vt-precompute / vt-train processes")
    startup = bench_startup(
        args.config, args.model, args.raw, pre["window"], work / "startup", args.startup_rounds, args.threads
    )
    stage(f"precompute throughput: {args.precompute_runs} rounds x service / naive loop / encode-only processes")
    throughput = bench_throughput(
        args.config, args.model, args.raw, work / "throughput", args.precompute_runs, args.threads
    )
    stage("done")
    info["load_avg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows = steps["rows"] + launch["rows"] + startup["rows"] + pre["rows"] + storage["rows"] + throughput["rows"]
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": info,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [row.to_dict() for row in rows],
        "table": format_table(rows),
        "details": {
            "precompute": [{k: v for k, v in r.items() if k != "window"} for r in pre["reports"]],
            "storage": {k: v for k, v in storage.items() if k != "rows"},
            "train_steps": {k: v for k, v in steps.items() if k != "rows"},
            "launch": {k: v for k, v in launch.items() if k != "rows"},
            "startup": {k: v for k, v in startup.items() if k != "rows"},
            "precompute_throughput": {k: v for k, v in throughput.items() if k != "rows"},
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    m = results["machine"]
    print(
        f"\nvt bench, {results['date']}, {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
        f"{args.threads or 'default'} thread(s), {results['seconds']}s\n"
    )
    print(results["table"])
    for row in results["rows"]:
        if row["note"]:
            print(f"  {row['name'].strip()}: {row['note']}")
    print(f"\nwritten to {args.out / 'results.json'}; how to read it: docs/benchmarks.md")
    load = max((m.get("load_avg_at_start") or [0])[0], (m.get("load_avg_at_end") or [0])[0])
    if m["cores"] and load > m["cores"]:
        print(
            f"note: the machine was busy (1-minute load {load:.1f} on {m['cores']} cores); ratios are noisier "
            "than usual, run `make bench` again on an idle machine before trusting a FAIL"
        )
    failed = [r["name"].strip() for r in results["rows"] if r["ok"] is False]
    if failed:
        print(f"over goal: {', '.join(failed)}")
    failed += ["FSDP2 scaling"] * __import__("bench_parallel").main(
        ["--out", str(args.out), "--strict"]
    )  # bench_parallel.py
    # bench_ray_decode.py: stage 1's decoding on Ray actors against a local decode worker (context rows, no goal)
    if importlib.util.find_spec("ray") is not None:
        __import__("bench_ray_decode").main(
            [
                "--out",
                str(args.out / "ray"),
                "--config",
                str(args.config),
                "--model",
                str(args.model),
                "--raw",
                str(args.raw),
            ]
        )
    # bench_scale.py: bytes read per trainer rank at 1, 2, 4 and 8 ranks (context rows, no goal)
    __import__("bench_scale").main(
        [
            "--out",
            str(args.out),
            "--config",
            str(args.config),
            "--model",
            str(args.model),
            "--raw",
            str(args.raw),
            "--threads",
            str(args.threads or 1),
        ]
    )
    # bench_producers.py: samples/s of 1 vs 2 producers on one window of 2 lanes, the claims' overhead (context rows)
    __import__("bench_producers").main(
        [
            "--out",
            str(args.out / "producers"),
            "--config",
            str(args.config),
            "--model",
            str(args.model),
            "--raw",
            str(args.raw),
            "--threads",
            str(args.threads or 1),
        ]
    )
    # bench_decode_cores.py: decode ms per real clip at 81x480x832 and 81x720x1280 on one core (context rows)
    __import__("bench_decode_cores").main(["--out", str(args.out)])
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
