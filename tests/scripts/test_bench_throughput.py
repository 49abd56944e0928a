"""The precompute throughput bench on real pieces: all three sides do the same samples, the
encode-only side is the service's own path, and the steady-state rate leaves the start-up out."""

from __future__ import annotations

import json

import pytest
from bench_common import ROOT
from bench_precompute_throughput import bench_throughput, steady_rate, window_outputs

from helpers.cli_runs import raw_keys
from helpers.forkserver import bench_launch

DEMO = ROOT / "configs" / "demo.toml"


def test_steady_rate_counts_from_the_first_output():
    second = 1_000_000_000
    # Start-up of 5 s before the first output, then one output of 8 samples a second.
    assert steady_rate([5 * second, 6 * second, 7 * second, 8 * second], [8, 8, 8, 8]) == (3 / 24, 24)
    assert steady_rate([8 * second, 5 * second, 7 * second], [8, 8, 8]) == (3 / 16, 16)  # any order
    with pytest.raises(RuntimeError, match="raise --repeats"):
        steady_rate([5 * second, 6 * second], [8, 8])


def test_three_sides_over_the_same_corpus(tmp_path, tiny_model_factory, raw_shards):
    model = tiny_model_factory("ltx-video")
    result = bench_throughput(
        DEMO, model, raw_shards, tmp_path, rounds=1, threads=1, repeats=2, workers=1, batch=4, launch=bench_launch
    )

    clips = len(raw_keys(raw_shards))
    assert {side: [r["samples"] for r in runs] for side, runs in result["runs"].items()} == {
        "service": [2 * clips],
        "naive": [2 * clips],
        "encode_only": [2 * clips],
    }
    assert len(list((tmp_path / "naive-0" / "naive").glob("*.safetensors"))) == 2 * clips

    def window_keys(side: str) -> list[str]:
        records = sorted((tmp_path / f"{side}-0" / "window" / "commits").rglob("*.json"))
        return sorted(key for record in records for key in json.loads(record.read_text())["keys"])

    service_keys = window_keys("service")
    assert len(set(service_keys)) == 2 * clips  # the corpus copies got distinct keys
    assert window_keys("encode_only") == service_keys  # decode made free, the rest is the service's

    # Full shards only (end-of-run remainders are left out), and at least three of them.
    times, counts = window_outputs(tmp_path / "service-0" / "window", 4)
    assert len(times) >= 3 and set(counts) == {4}
    per_sample = result["s_per_sample"]
    assert all(value > 0 for value in per_sample.values())
    vs_naive, vs_encode = result["rows"][:2]
    assert (vs_naive.vt, vs_naive.baseline) == (per_sample["service"], per_sample["naive"])
    assert (vs_encode.vt, vs_encode.baseline) == (per_sample["service"], per_sample["encode_only"])
    assert vs_naive.max_ratio == pytest.approx(1 / 1.3, abs=1e-3) and vs_encode.max_ratio == 1.25
