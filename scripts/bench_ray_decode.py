"""Stage 1's decoding on Ray against local decode workers: the same producer, `precompute.engine = "ray"` with 1 and
2 decode actors against `precompute.workers = 1` (issue 27's numbers).

Each side is the real service (`Precompute(config).run()`) in a fresh process over the demo raw shards repeated
into a longer corpus, its rate the steady state between its first and last full shards' commits (start-up, the
cluster connection included, left out: bench_precompute_throughput.steady_rate). The Ray sides reach a head this
script starts (`ray start --head` in a session of its own, RAY_ADDRESS as on a cluster) and stops at the end.
Rounds rotate which side goes first; rows quote medians and the ratio against the local workers. On a machine
whose cores the encoder already uses, more actors cannot decode faster; on a cluster they add cores.

    python scripts/bench_ray_decode.py [--rounds 3] [--out runs/bench-ray]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_common import ROOT, Row, asset_arguments, format_table, median, run_timed, write_run_config  # noqa: E402
from bench_precompute_throughput import make_corpus, steady_rate, throughput_overrides, window_outputs  # noqa: E402
from ray_head import RAY_ENV, start_head, stop_head  # noqa: E402

SIDES = {
    "local workers 1": ["precompute.workers=1"],
    "ray actors 1": ['precompute.engine="ray"', "precompute.ray_actors=1"],
    "ray actors 2": ['precompute.engine="ray"', "precompute.ray_actors=2"],
}


def bench_ray_decode(
    base_config: Path, model: Path, raw: Path, work: Path, rounds: int, threads: int, repeats: int = 6, batch: int = 8
) -> dict:
    corpus = make_corpus(raw, work / "corpus", repeats)
    head, address = start_head(work / "ray-head.log", cpus=os.cpu_count() or 2)
    runs: dict[str, list[float]] = {side: [] for side in SIDES}
    names = list(SIDES)
    try:
        for round_index in range(rounds):
            for side in names[round_index % len(names) :] + names[: round_index % len(names)]:
                run_dir = work / f"{side.replace(' ', '-')}-{round_index}"
                shutil.rmtree(run_dir, ignore_errors=True)
                overrides = throughput_overrides(model, corpus, run_dir, run_dir / "window", 0, batch) + SIDES[side]
                config = write_run_config(base_config, run_dir.with_suffix(".toml"), overrides)
                run_timed(
                    [str(Path(sys.executable).with_name("vt-precompute")), "run", str(config)],
                    run_dir.with_suffix(".log"),
                    threads,
                    timeout=900,
                    env={**RAY_ENV, "RAY_ADDRESS": address},
                )
                runs[side].append(steady_rate(*window_outputs(run_dir / "window", batch))[0])
    finally:
        stop_head(head)
    local = median(runs["local workers 1"])
    rows = [
        Row(
            f"precompute s/sample: {side} vs local workers 1",
            median(values),
            "s",
            baseline=local,
            note="steady state; Ray on this machine's cores" if side == "ray actors 1" else "",
        )
        for side, values in runs.items()
        if side != "local workers 1"
    ]
    rows.append(Row("  precompute samples/s: local workers 1", 1 / local, "/s"))
    return {"rows": rows, "s_per_sample": {side: median(values) for side, values in runs.items()}, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    asset_arguments(parser, ROOT / "runs/bench-ray")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per producer")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = bench_ray_decode(args.config, args.model, args.raw, args.out, args.rounds, args.threads)
    print(format_table(result["rows"]))
    (args.out / "ray_decode.json").write_text(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
