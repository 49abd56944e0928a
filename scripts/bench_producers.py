"""Stage 1 with one producer against two on one window: the lane claims' overhead (issue 27 part 5).

Both sides run the real service: `vt-precompute run CONFIG` processes over the demo raw shards repeated into a
longer corpus, into a fresh kept window (`window.size = "keep"`: no trainer, no backpressure) of
`precompute.lanes = 2`. Side A is one producer: it claims a lane, works it to its done marker, then claims the
other. Side B is two producers started together: each claims a lane (of two claiming the same, one wins the
exclusive create and the other takes the next), and the one that finishes first, holding no lane, lists `done/`
every min(claim_seconds / 4, 2 s) until the other's lane is done too. samples/s = the samples committed (the
window's commit records; each producer's report must agree) / the wall time from launching the side's processes
to the last one's exit, start-up included. The corpus deals each copy's tars to the lanes in turn, so both lanes
hold the same samples. A second row leaves start-up out: samples/s from the first full shard's commit to the
last (bench_precompute_throughput.steady_rate).

Rounds alternate which side goes first; rows quote medians and the ratio B / A. Every producer has one torch
thread and one decode worker (the demo's settings; `--workers`), so side A runs two busy processes and side B
four: on a machine with fewer cores than that, side B is CPU-bound and its ratio shows what claiming lanes costs
(start-up twice at once, the claims, the heartbeats, the finished producer's end check) on top of sharing the
cores, not a speed-up. On separate machines each producer brings its own cores.

    python scripts/bench_producers.py [--rounds 3] [--repeats 40] [--out runs/bench-producers]
    python scripts/bench_producers.py --quick          # 1 round over 2 copies, no decode workers: the test's size

`make bench` runs it after scripts/bench.py's own rows (its raw numbers go to <out>/producers/producers.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_common import (
    BIN,
    ROOT,
    Row,
    asset_arguments,
    child_env,
    format_table,
    machine,
    median,
    popen,
    write_run_config,  # noqa: E402
)
from bench_precompute_throughput import steady_rate, throughput_overrides, window_outputs  # noqa: E402

LANES = 2
SIDES = {"1 producer": 1, "2 producers": 2}


def make_lane_corpus(raw: Path, out: Path, repeats: int) -> Path:
    """The raw tars `repeats` times over, each copy's keys prefixed (c000-...), named so that the sorted list deals
    copy c's tars to the lanes rotated by c: with an even number of copies every lane gets every tar equally often
    (the demo's two tars hold 8 and 5 samples; without the rotation lane 0 would get all the 8s)."""
    tars = sorted(Path(raw).glob("*.tar"))
    if not tars:
        raise FileNotFoundError(f"no .tar shards in {raw}: build them with `make assets`")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for copy in range(repeats):
        rotated = tars[copy % len(tars) :] + tars[: copy % len(tars)]
        for slot, tar in enumerate(rotated):
            prefix = f"c{copy:03d}"
            with (
                tarfile.open(tar) as source,
                tarfile.open(out / f"{prefix}-{slot}-{tar.name}", "w", format=tarfile.USTAR_FORMAT) as dest,
            ):
                for member in source:
                    data = source.extractfile(member) if member.isfile() else None
                    member.name = f"{prefix}-{member.name}"
                    dest.addfile(member, data)
    return out


def committed_keys(window: Path) -> list[str]:
    """Every sample key of the window's commit records (each lane's `commits/p<l>/`)."""
    return [
        key for record in sorted((window / "commits").rglob("*.json")) for key in json.loads(record.read_text())["keys"]
    ]


def run_side(config: Path, producers: int, work: Path, name: str, threads: int, timeout: float, launch=popen) -> dict:
    """`producers` `vt-precompute run` processes launched together on one config (`launch`: bench_common.popen);
    (wall seconds, committed, ...)."""
    env = child_env(threads)
    started = time.perf_counter()
    procs = [
        launch([str(BIN / "vt-precompute"), "run", str(config)], work / f"{name}.p{i}.log", env)
        for i in range(producers)
    ]
    exits: dict[int, float] = {}
    try:
        while len(exits) < len(procs):  # each one's own exit time, in whichever order they end
            for index, proc in enumerate(procs):
                if index not in exits and proc.poll() is not None:
                    exits[index] = time.perf_counter() - started
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"{name}: the producers ran past {timeout:.0f}s; their output is in {work}")
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = max(exits.values())
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        text = (work / f"{name}.p{failed[0]}.log").read_text(errors="replace")
        raise RuntimeError(
            f"vt-precompute producer {failed[0]} of {name} exited with {procs[failed[0]].returncode}; "
            f"its output is in {work / f'{name}.p{failed[0]}.log'}:\n{text[-3000:]}"
        )
    return {"wall_s": wall, "exits_s": sorted(exits.values())}


def bench_producers(
    base_config: Path,
    model: Path,
    raw: Path,
    work: Path,
    rounds: int,
    threads: int,
    repeats: int = 40,
    batch: int = 8,
    workers: int = 1,
    timeout: float = 600,
    launch=popen,
) -> dict:
    """`rounds` x both sides (fresh processes, a fresh window each), alternating which goes first; medians.
    `launch` starts the processes (bench_common.popen)."""
    corpus = make_lane_corpus(raw, work / "corpus", repeats)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    names = list(SIDES)
    for round_index in range(rounds):
        for side in names if round_index % 2 == 0 else names[::-1]:
            producers = SIDES[side]
            label = f"{side.replace(' ', '-')}-{round_index}"
            run_dir = work / label
            shutil.rmtree(run_dir, ignore_errors=True)
            overrides = throughput_overrides(model, corpus, run_dir, run_dir / "window", workers, batch) + [
                f"precompute.lanes={LANES}"
            ]
            config = write_run_config(base_config, run_dir.with_suffix(".toml"), overrides)
            result = run_side(config, producers, work, label, threads, timeout, launch)
            keys = committed_keys(run_dir / "window")
            reports = [json.loads(p.read_text()) for p in sorted(run_dir.glob("precompute_report*.json"))]
            if len(reports) != producers:
                raise RuntimeError(f"{label}: {len(reports)} producer reports in {run_dir}, expected {producers}")
            if sum(r["committed"] for r in reports) != len(keys) or len(set(keys)) != len(keys):
                raise RuntimeError(
                    f"{label}: the reports count {sum(r['committed'] for r in reports)} samples, the "
                    f"window holds {len(keys)} ({len(set(keys))} distinct)"
                )
            try:
                steady, _ = steady_rate(*window_outputs(run_dir / "window", batch))
            except RuntimeError:  # too few full shards (the quick size): no steady-state rate
                steady = None
            result.update(
                committed=len(keys),
                samples_per_s=len(keys) / result["wall_s"],
                steady_samples_per_s=None if steady is None else 1 / steady,
                lanes={r["producer"]: r["lanes"] for r in reports},
                elapsed_s={r["producer"]: r["elapsed_s"] for r in reports},
            )
            runs[side].append(result)
    counts = {side: [r["committed"] for r in results] for side, results in runs.items()}
    samples = counts["1 producer"][0]
    if any(c != samples for values in counts.values() for c in values):
        raise RuntimeError(f"the sides committed different sample counts: {counts}")
    one = median([r["samples_per_s"] for r in runs["1 producer"]])
    two = median([r["samples_per_s"] for r in runs["2 producers"]])
    cores = os.cpu_count() or 1
    rows = [
        Row(
            "producers samples/s: 2 vs 1 on one window (2 lanes)",
            two,
            "/s",
            baseline=one,
            note=f"{samples} samples, wall from launch to the last exit (start-up included), median of {rounds}; "
            f"{cores} cores for 2 producers of {1 + workers} busy process{'es' if workers else ''} each: "
            + (
                "CPU-bound, the ratio is the claims' overhead plus shared cores, not a speed-up"
                if cores < 2 * (1 + workers)
                else "each producer has cores of its own"
            ),
        )
    ]
    for side, results in runs.items():
        rows.append(Row(f"  producers wall s: {side}", median([r["wall_s"] for r in results]), "s"))
    steady = {
        side: [r["steady_samples_per_s"] for r in results if r["steady_samples_per_s"]]
        for side, results in runs.items()
    }
    if all(steady.values()):
        rows.append(
            Row(
                "  producers samples/s, first to last full shard: 2 vs 1",
                median(steady["2 producers"]),
                "/s",
                baseline=median(steady["1 producer"]),
                note="start-up left out (steady_rate)",
            )
        )
    return {
        "rows": rows,
        "samples": samples,
        "samples_per_s": {"1 producer": one, "2 producers": two},
        "ratio": two / one,
        "runs": runs,
        "settings": {
            "rounds": rounds,
            "repeats": repeats,
            "batch": batch,
            "lanes": LANES,
            "threads": threads,
            "workers": workers,
        },
    }


def main(argv: list[str] | None = None, launch=popen) -> int:
    """The bench from the command line; `launch` starts its processes (bench_common.popen)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    asset_arguments(parser, ROOT / "runs/bench-producers")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both sides, alternating which goes first")
    parser.add_argument(
        "--repeats",
        type=int,
        default=40,
        help="copies of the raw tars in the corpus (even: both lanes get the same samples)",
    )
    parser.add_argument("--batch", type=int, default=8, help="samples per shard and per VAE batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per producer")
    parser.add_argument("--workers", type=int, default=1, help="decode workers per producer (precompute.workers)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 round over 2 copies, decoding in each producer's own process (workers 0): the test's "
        "size, for the plumbing, not for numbers",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats, args.workers = 1, 2, 0
    for name in ("rounds", "repeats", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not (args.model / "model_index.json").exists() or not sorted(args.raw.glob("*.tar")):
        parser.error(f"missing {args.model} or the tars in {args.raw}: build them with `make assets`")
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine()
    started = time.perf_counter()
    result = bench_producers(
        args.config,
        args.model,
        args.raw,
        args.out,
        args.rounds,
        args.threads,
        args.repeats,
        args.batch,
        args.workers,
        launch=launch,
    )
    info["load_avg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(format_table(result["rows"]))
    for row in result["rows"]:
        if row.note:
            print(f"  {row.name.strip()}: {row.note}")
    print(
        f"ratio 2 producers / 1 producer: {result['ratio']:.3f}x ({time.perf_counter() - started:.0f}s, 1-minute "
        f"load {info['load_avg_at_start'][0]:.1f} at the start, {info['load_avg_at_end'][0]:.1f} at the end)"
    )
    out = {k: v for k, v in result.items() if k != "rows"}
    (args.out / "producers.json").write_text(
        json.dumps({**out, "machine": info, "rows": [r.to_dict() for r in result["rows"]]}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
