"""The bench's measuring parts on real pieces: the bare baseline must do the trainer's exact work,
the storage count must cover every window file, and a row over its goal must show as a failure."""

from __future__ import annotations

import pytest
import torch
from bench_common import ROOT, Row, format_table
from bench_precompute import precompute_overrides
from bench_storage import bench_storage, window_bytes
from bench_train import bench_steps

from vt.shared.config import load_config
from vt.shared.shards import decode_shard

DEMO = ROOT / "configs" / "demo.toml"


@pytest.fixture(scope="module")
def kept_window(tmp_path_factory, tiny_model_factory, raw_shards):
    """A window precomputed once from the real clips with the demo config's settings (kept: re-readable)."""
    from vt.precompute.service import Precompute

    root = tmp_path_factory.mktemp("bench")
    overrides = precompute_overrides(tiny_model_factory("ltx-video"), raw_shards, root / "pre", root / "window")
    report = Precompute(load_config(DEMO, overrides + ["precompute.workers=0"])).run()
    return root / "window", report.committed


def test_bare_loop_and_trainer_report_identical_losses_on_the_same_batches(tmp_path, tiny_model_factory, kept_window):
    model = tiny_model_factory("ltx-video")
    window, _ = kept_window
    result = bench_steps(DEMO, model, model / "transformer", window, tmp_path, rounds=2, steps=4)

    # From equal weights, with the trainer's own draws replayed, the bare loop reports the same losses.
    losses = result["parity_losses"]
    assert len(losses["vt"]) == len(losses["bare"]) == 4
    assert result["parity"] <= 1e-6, losses
    assert len(set(losses["vt"])) > 1  # the losses move: the steps really trained
    assert [len(result["round_times_s"][side]) for side in ("vt", "bare")] == [2, 2]
    step_row, parity_row = result["rows"]
    assert step_row.baseline == pytest.approx(result["bare_ms"]) and step_row.ratio > 0
    assert parity_row.ok is True


def test_storage_counts_every_window_file_against_one_fp32_file_per_sample(tmp_path, kept_window):
    window, samples = kept_window
    result = bench_storage(window, tmp_path, samples)

    files = sorted((tmp_path / "fp32-per-sample").glob("*.pt"))
    assert len(files) == samples
    assert result["fp32_total_bytes"] == sum(f.stat().st_size for f in files)
    on_disk = sum(p.stat().st_size for p in window.rglob("*") if p.is_file())
    assert sum(window_bytes(window).values()) == on_disk
    stored, data_only, wan = result["rows"]
    assert stored.vt == pytest.approx(on_disk / samples)
    assert data_only.vt < stored.vt
    assert stored.ok  # <= 0.25x: each caption stored once, trimmed to its tokens
    # Wan 2.1's real shapes: 4 MiB of latents and 4 MiB of padded UMT5 text per sample before.
    assert wan.baseline > 8.3e6 and wan.vt < 0.65 * wan.baseline

    # A baseline file holds exactly one sample's tensors (not the shard's whole stacked storage), in fp32.
    shard = next((window / "data").rglob("*.safetensors"))
    tensors, keys, _ = decode_shard(shard.read_bytes())
    saved = torch.load(tmp_path / "fp32-per-sample" / f"{keys[0].replace('/', '__')}.pt")
    assert set(saved) == set(tensors)
    for name, tensor in tensors.items():
        assert saved[name].dtype == torch.float32 and saved[name].shape == tensor.shape[1:]
        torch.testing.assert_close(saved[name], tensor[0].float())


def test_a_row_over_its_goal_is_marked_fail_in_the_table():
    fast = Row("step", 10.2, "ms", baseline=10.0, max_ratio=1.03)
    slow = Row("step slow", 10.5, "ms", baseline=10.0, max_ratio=1.03)
    info = Row("stage", 0.5, "s")
    assert (fast.ok, slow.ok, info.ok) == (True, False, None)
    table = format_table([fast, slow, info]).splitlines()
    assert table[2].split()[-1] == "ok" and table[3].split()[-1] == "FAIL" and table[4].split()[-1] == "-"
    assert "1.050x" in table[3]


def test_bench_refuses_missing_assets_and_says_how_to_build_them(tmp_path, capsys):
    from bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path / "nope"), "--raw", str(tmp_path)])
    assert "make assets" in capsys.readouterr().err


def test_bare_launch_script_trains_on_the_window_shard_files(tiny_model_factory, kept_window, capsys):
    import json

    from bench_bare import main, window_batches

    window, samples = kept_window
    batches = window_batches(window, batch_size=2)
    first_pass = []
    while sum(len(b["latents"]) for b in first_pass) < samples:
        first_pass.append(next(batches))
    assert sum(len(b["latents"]) for b in first_pass) == samples  # every sample once per pass, none twice
    assert all(b["latents"].dtype == torch.float32 and 1 <= len(b["latents"]) <= 2 for b in first_pass)

    main(
        ["--transformer", str(tiny_model_factory("ltx-video") / "transformer"), "--window", str(window), "--steps", "3"]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["step_done"]) == 3 and result["step_done"] == sorted(result["step_done"])
    assert all(0 < loss < 100 for loss in result["losses"])


def test_start_up_rows_time_both_stages_from_launch_against_a_bare_import(
    tmp_path, tiny_model_factory, raw_shards, kept_window
):
    from bench_startup import bench_startup

    window, _ = kept_window
    result = bench_startup(DEMO, tiny_model_factory("ltx-video"), raw_shards, window, tmp_path, rounds=1, threads=1)
    pre_row, train_row = result["rows"]
    assert len(result["bare_s"]) == 2 and pre_row.baseline == train_row.baseline == pytest.approx(
        sum(result["bare_s"]) / 2
    )
    for row, side, last in ((pre_row, "precompute", "first_decoded_sample"), (train_row, "train", "first_step")):
        run = result[side][0]
        assert row.vt == run["first_s"] and row.max_ratio == 1.5 and row.ratio == row.vt / row.baseline
        assert list(run["parts_s"])[0] == "imports" and list(run["parts_s"])[-1] == last
        # the launch as the bench saw it and as the process recorded it agree: the parts add up to first_s
        assert sum(run["parts_s"].values()) == pytest.approx(run["first_s"], abs=0.5)
        assert run["first_s"] < run["process_s"]
        assert "parts: imports" in row.note


def test_scale_rows_compare_each_world_with_one_process_and_its_share():
    """bench_scale.py's rows from counts: the largest rank per step against one process, and its rows and
    captions (less headers and caption tables) against 1/D of the global batch's bytes."""
    from bench_scale import parse_args as scale_args
    from bench_scale import rows_for
    from scale_window import RunBytes, ShardBytes

    shard = ShardBytes(header=100, table=16, rows=[50] * 4, caption=[0, 0, 1, 1], caption_bytes=[30, 40])
    run = RunBytes([shard, shard], batch_size=8, batches=[[(s, r) for s in range(2) for r in range(4)]])
    assert run.global_bytes == 8 * 50 + 4 * 30 + 4 * 40
    assert run.rank_reads(0, 1)["data"] == 2 * (100 + 16) + 8 * 50 + 2 * (30 + 40)
    assert run.rank_reads(1, 2) == {"shards": 1, "headers": 100, "tables": 16, "rows": 200, "captions": 70, "data": 386}
    counts = {
        1: {"steps": 1, "ranks": [{"bytes:data": 772, "header_bytes:data": 200, "reads:data": 6, "headers:data": 2}]},
        2: {
            "steps": 1,
            "ranks": [{"bytes:data": 386, "header_bytes:data": 100, "reads:data": 3, "headers:data": 1}] * 2,
        },
    }
    rows = rows_for(counts, run)
    assert [round(r.ratio, 3) for r in rows] == [1.0, round(540 / 680, 3), 0.5, round(270 / 340, 3)]
    with pytest.raises(SystemExit):
        scale_args(["--worlds", "1", "3"])  # 3 does not divide the batch of 8


def test_producers_bench_commits_every_sample_with_one_and_two_producers(
    tmp_path, tiny_model_factory, raw_shards, capsys
):
    """bench_producers.py --quick: one round of each side over 2 copies of the raw shards, 2 lanes; both sides
    commit every sample once, the two producers split the lanes, and the ratio is printed."""
    import json
    import re

    from bench_producers import main

    from helpers.cli_runs import raw_keys
    from helpers.forkserver import bench_launch

    assert (
        main(
            [
                "--quick",
                "--model",
                str(tiny_model_factory("ltx-video")),
                "--raw",
                str(raw_shards),
                "--out",
                str(tmp_path),
            ],
            launch=bench_launch,  # forked from a warm interpreter: the test checks the plumbing, not the numbers
        )
        == 0
    )
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "producers.json").read_text())
    samples = 2 * len(raw_keys(raw_shards))
    assert {side: [r["committed"] for r in runs] for side, runs in result["runs"].items()} == {
        "1 producer": [samples],
        "2 producers": [samples],
    }
    (one,), (two,) = result["runs"]["1 producer"], result["runs"]["2 producers"]
    assert sorted(lane for lanes in one["lanes"].values() for lane in lanes) == [0, 1] and len(one["lanes"]) == 1
    assert len(two["lanes"]) == 2 and len(two["exits_s"]) == 2  # both producers ran to their exit
    assert sorted(lane for lanes in two["lanes"].values() for lane in lanes) == [0, 1]  # each lane worked once
    ratio = float(re.search(r"ratio 2 producers / 1 producer: ([0-9.]+)x", out).group(1))
    assert ratio == pytest.approx(result["ratio"], abs=1e-3) and ratio > 0
    assert "producers samples/s: 2 vs 1" in out
