"""Precompute cost per sample: the real `vt-precompute run` over the demo raw shards.

Each run is a fresh process into a fresh window; the numbers come from its precompute_report.json
(elapsed from the service's start, and seconds per stage) plus the process wall time, which also
counts Python and library start-up. The report's `decode` seconds are summed over decode workers,
which run beside the encoder, so stages need not add up to the elapsed time.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_common import BIN, Row, median, run_timed, toml_string, write_run_config

STAGES = ("read", "decode", "text_encode", "vae_encode", "write", "wait")


def precompute_overrides(model: Path, raw: Path, run_dir: Path, window: Path) -> list[str]:
    """One pass over the raw shards into a kept window (no trainer, so no backpressure waits)."""
    return [
        f"model.path={toml_string(model)}",
        f"data.raw={toml_string(raw)}",
        f"run.dir={toml_string(run_dir)}",
        f"window.uri={toml_string(window)}",
        'window.size="keep"',
        "log.progress=false",
    ]


def run_precompute(base_config: Path, model: Path, raw: Path, work: Path, name: str, threads: int) -> dict:
    """One `vt-precompute run`; returns its report plus `process_s` and the window path."""
    run_dir, window = work / name, work / name / "window"
    config = write_run_config(base_config, work / f"{name}.toml", precompute_overrides(model, raw, run_dir, window))
    _, seconds, _ = run_timed([str(BIN / "vt-precompute"), "run", str(config)], work / f"{name}.log", threads)
    report = json.loads((run_dir / "precompute_report.json").read_text())
    if report["committed"] == 0:
        raise RuntimeError(
            f"vt-precompute committed no samples from {raw}; see {run_dir}/precompute_report.json "
            "(rejected counts by reason) and rebuild the assets with `make assets`"
        )
    return {**report, "process_s": seconds, "window": str(window)}


def bench_precompute(base_config: Path, model: Path, raw: Path, work: Path, runs: int, threads: int) -> dict:
    """`runs` precompute processes; rows are medians of seconds per committed sample."""
    reports = [run_precompute(base_config, model, raw, work, f"precompute-{i}", threads) for i in range(runs)]
    per_sample = lambda value, r: value / r["committed"]  # noqa: E731
    rows = [
        Row(
            "precompute s/sample (report elapsed)",
            median([per_sample(r["elapsed_s"], r) for r in reports]),
            "s",
            note=f"{reports[0]['committed']} samples, {reports[0]['shards']} shards, median of {runs} runs",
        ),
        Row(
            "precompute s/sample (process, incl. start-up)",
            median([per_sample(r["process_s"], r) for r in reports]),
            "s",
        ),
    ]
    for stage in STAGES:
        values = [per_sample(r["seconds"].get(stage, 0.0), r) for r in reports]
        if any(values):
            rows.append(Row(f"  precompute stage {stage} s/sample", median(values), "s"))
    return {"rows": rows, "reports": reports, "window": Path(reports[0]["window"]), "samples": reports[0]["committed"]}
