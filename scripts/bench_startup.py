"""Start-up: seconds from launch to the first useful work of each stage, against a bare Python's imports.

Each round runs, in an order that alternates, three processes: a bare `python -c "import torch,
diffusers"` (the least any vt process must pay), `vt-precompute run` over the demo raw shards into a
fresh window (launch -> its first decoded sample, from the start-up timeline in precompute_report.json)
and `vt-train run` on a ready window (launch -> the end of its first step, from metrics.jsonl). Rows
are medians; each vt row also shows its median start-up parts (vt.shared.startup), written to
results.json and summed up in docs/benchmarks.md.

    python scripts/bench_startup.py [--rounds 3]    (make bench runs it through scripts/bench.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import BIN, ROOT, Row, median, run_timed, toml_string, write_run_config  # noqa: E402
from bench_precompute import precompute_overrides  # noqa: E402

GOAL = 1.5  # launch -> first useful work at most 1.5x a bare import of torch and diffusers
BARE = "import torch, diffusers"


def bare_import(work: Path, name: str, threads: int) -> float:
    started, seconds, _ = run_timed([sys.executable, "-c", BARE], work / f"{name}.log", threads)
    return seconds


def precompute_start(config: Path, model: Path, raw: Path, work: Path, name: str, threads: int) -> dict:
    run_dir = work / name
    cfg = write_run_config(config, work / f"{name}.toml", precompute_overrides(model, raw, run_dir, run_dir / "window"))
    started, seconds, _ = run_timed([str(BIN / "vt-precompute"), "run", str(cfg)], work / f"{name}.log", threads)
    startup = json.loads((run_dir / "precompute_report.json").read_text())["startup"]
    first = startup["launched_at"] + startup["marks_s"]["first_decoded_sample"] - started
    return {"first_s": first, "parts_s": startup["parts_s"], "process_s": seconds}


def train_start(config: Path, model: Path, window: Path, work: Path, name: str, threads: int) -> dict:
    run_dir = work / name
    overrides = [
        f"model.path={toml_string(model)}",
        f"window.uri={toml_string(window)}",
        'window.size="keep"',
        f"run.dir={toml_string(run_dir)}",
        "train.max_steps=2",
        "validation.every=0",
        "train.checkpoint_every=0",
        "validation.prompts=[]",
        "log.progress=false",
    ]
    cfg = write_run_config(config, work / f"{name}.toml", overrides)
    started, seconds, _ = run_timed([str(BIN / "vt-train"), "run", str(cfg)], work / f"{name}.log", threads)
    first_step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["time"]
    startup = json.loads((run_dir / "startup.json").read_text())
    return {"first_s": first_step - started, "parts_s": startup["parts_s"], "process_s": seconds}


def _median_parts(runs: list[dict]) -> dict[str, float]:
    return {part: round(median([r["parts_s"].get(part, 0.0) for r in runs]), 3) for part in runs[0]["parts_s"]}


def bench_startup(config: Path, model: Path, raw: Path, window: Path, work: Path, rounds: int, threads: int) -> dict:
    """`rounds` rounds of (bare import, vt-precompute, vt-train) in rotating order; medians."""
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list] = {"bare": [], "precompute": [], "train": []}
    order = ["bare", "precompute", "bare", "train"]  # the bare side between the two vt sides
    for index in range(rounds):
        for side in order if index % 2 == 0 else order[::-1]:
            name = f"startup-{side}-{index}-{len(runs[side])}"
            if side == "bare":
                runs["bare"].append(bare_import(work, name, threads))
            elif side == "precompute":
                runs["precompute"].append(precompute_start(config, model, raw, work, name, threads))
            else:
                runs["train"].append(train_start(config, model, window, work, name, threads))
    bare = median(runs["bare"])
    parts = {side: _median_parts(runs[side]) for side in ("precompute", "train")}

    def note(side: str) -> str:
        return "parts: " + ", ".join(f"{k} {v:.2f}s" for k, v in parts[side].items())

    rows = [
        Row(
            "launch -> first decoded sample: vt-precompute vs bare import",
            median([r["first_s"] for r in runs["precompute"]]),
            "s",
            baseline=bare,
            max_ratio=GOAL,
            note=f'median of {rounds}; baseline `python -c "{BARE}"` ({len(runs["bare"])} runs); {note("precompute")}',
        ),
        Row(
            "launch -> first step: vt-train (ready window) vs bare import",
            median([r["first_s"] for r in runs["train"]]),
            "s",
            baseline=bare,
            max_ratio=GOAL,
            note=note("train"),
        ),
    ]
    return {
        "rows": rows,
        "bare_s": runs["bare"],
        "precompute": runs["precompute"],
        "train": runs["train"],
        "parts_s": parts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/demo.toml")
    parser.add_argument("--model", type=Path, default=ROOT / "runs/models/ltx-video-tiny")
    parser.add_argument("--raw", type=Path, default=ROOT / "runs/data/raw")
    parser.add_argument("--window", type=Path, default=None, help="a ready window (default: made by a first run)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench/startup")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from bench_common import format_table

    window = args.window
    if window is None:  # a kept window for the trainer's side, made by one precompute run first
        precompute_start(args.config, args.model, args.raw, args.out, "window", args.threads)
        window = args.out / "window" / "window"
    result = bench_startup(args.config, args.model, args.raw, window, args.out, args.rounds, args.threads)
    print(format_table(result["rows"]))
    for row in result["rows"]:
        print(f"  {row.name}: {row.note}")
    (args.out / "results.json").write_text(
        json.dumps(
            {k: v for k, v in result.items() if k != "rows"} | {"rows": [r.to_dict() for r in result["rows"]]}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
