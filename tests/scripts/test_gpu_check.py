"""scripts/gpu_check.py's CPU dry run: every row of the GPU table (each attention backend this
machine trains with, no activation checkpointing, fp8 tensorwise/rowwise against bf16, LoRA on an
fp8 against a bf16 base, the plan row) trains a tiny model through vt's own pieces and lands in one table;
the run rows take `vt-train run` itself under torchrun, on the tiny presets of the families they run at
real size on a GPU, from start-up through validation."""

from __future__ import annotations

import json
import math

import gpu_check
from bench_common import popen

from helpers.forkserver import launch_ranks


def test_dry_run_trains_every_row_and_prints_one_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    groups = [arg for group in ("full", "fp8", "lora", "plan") for arg in ("--only", group)]
    assert gpu_check.main(["--dry", "--json", str(out), *groups]) == 0
    rows = json.loads(out.read_text())
    labels = [r["case"] for r in rows]
    assert labels == [
        "full, native, AC",
        "full, native_math, AC",
        "full, native, no AC",
        "fp8, native, AC, bf16",
        "fp8, native, AC, fp8 tensorwise",
        "fp8, native, AC, fp8 rowwise",
        "lora, native, AC, bf16 base",
        "lora, native, AC, fp8 base",
        "plan, native, AC, bf16 base",
    ]
    for row in rows:
        assert row["note"] == "" or row["group"] == "plan", row
        assert row["tokens"] == 16 and row["step_ms"] > 0
        assert len(row["losses"]) == 1 and all(math.isfinite(v) for v in row["losses"])
    # fp8 and bf16 start from the same weights and batch: their first losses agree to float8's precision
    first = {r["fp8"]: r["losses"][0] for r in rows if r["group"] == "fp8"}
    assert abs(first["tensorwise"] - first["none"]) < 0.05 * first["none"]
    assert first["tensorwise"] != first["none"], "the float8 rows must really run float8 matmuls"
    plan = rows[-1]  # the 14B LoRA row at real size on a GPU: the plan's estimate beside the measured peak
    assert plan["plan_gib"] > 0 and plan["note"].startswith("plan ")
    table = capsys.readouterr().out
    assert "| case | tokens | step ms | tokens/s | MFU | peak GiB | note |" in table
    assert table.count("\n| ") == len(rows) + 2  # header, rule, one line per row


def test_model_flops_count_six_per_weight_per_token_plus_attention():
    """The MFU numerator: 6 x the blocks' linear weights x tokens, plus the attention products."""
    shape = gpu_check.WAN_1_3B
    d, f, s, t = 1536, 8960, 32760, 512
    assert shape.tokens == s
    linear = 6 * s * (6 * d * d + 2 * d * f) + 6 * t * 2 * d * d
    attention = 3 * (4 * s * s * d + 4 * s * t * d)
    blocks = shape.layers * (linear + attention)
    assert blocks < gpu_check.model_flops_per_sample(shape) < blocks * 1.01


def torchrun_forked_after_the_first(launched: list):
    """gpu_real_run's `launch`: the first row's torchrun command runs as gpu_check.sh runs it (a fresh torchrun
    and its worker), the later rows' ranks fork from the warm interpreter as torchrun would start them
    (helpers.forkserver.launch_ranks: its environment, the same entry point and arguments), without the two
    interpreters' imports per row."""

    def launch(command: list[str], log, env):
        launched.append(command)
        if len(launched) == 1:
            return popen(command, log, env)
        at = next(i for i, arg in enumerate(command) if arg.startswith("--nproc-per-node="))
        nproc, trainer = int(command[at].split("=")[1]), command[at + 1 :]
        if trainer[:2] == ["-m", "vt.train"]:
            trainer = ["vt-train", *trainer[2:]]
        return launch_ranks(trainer[0], nproc, *trainer[1:], log=log, env=env)

    return launch


def test_dry_run_rows_train_and_validate_through_vt_train_run(tmp_path, capsys):
    out = tmp_path / "rows.json"
    launched: list[list[str]] = []
    argv = ["--dry", "--only", "run", "--json", str(out), "--work", str(tmp_path / "work")]
    assert gpu_check.main(argv, launch=torchrun_forked_after_the_first(launched)) == 0
    assert [command[1:4] for command in launched] == [["-m", "torch.distributed.run", "--standalone"]] * 4
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == [
        "run, Wan 2.1 14B LoRA",
        "run, HunyuanVideo 1.5 480p LoRA",
        "run, Wan 2.1 14B LoRA, one GPU capped at 24 GiB",
        "run, Wan 2.1 14B LoRA, NF4 base, one GPU capped at 24 GiB",
    ]
    for row in rows:
        assert row["note"].startswith("plan ") and row["videos"] == 1 == row["base_videos"], row  # exited 0, validated
        assert len(row["losses"]) == 4 and all(math.isfinite(v) for v in row["losses"])
        assert row["plan_gib"] > 0 and row["tokens"] > 0 and row["step_ms"] > 0
    # the small-card row trains with the settings docs/memory.md names for a 24 GB card, through the capped launcher
    log = (tmp_path / "work" / "wan2_1-14b-cap24-run.log").read_text()
    assert rows[2]["gpus"] == 1 and "block swap: " in log and rows[2]["losses"] == rows[0]["losses"]
    assert all(row["pinned_gib"] == 0 and row["host_gib"] > 0 for row in rows)  # nothing page-locked on a CPU
    nf4 = (tmp_path / "work" / "wan2_1-14b-cap24-nf4-run.log").read_text()
    assert rows[3]["gpus"] == 1 and "quantize" in nf4.lower() and rows[3]["losses"] != rows[0]["losses"]
    table = capsys.readouterr().out
    assert table.count("| run, ") == 4
