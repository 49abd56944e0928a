"""Kill the trainer (SIGKILL) right after a checkpoint, resume, and the losses match an uninterrupted run."""

from __future__ import annotations

import pytest

from vt.train.trackers import read_metrics

from helpers.cli_runs import finish, start, write_config


def losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")}  # a re-logged step: last wins


def test_resume_after_kill_repeats_the_uninterrupted_losses(tmp_path, tiny_model_factory, raw_shards, kept_window):
    def config(name):
        return write_config(
            tmp_path / f"{name}.toml",
            tiny_model_factory("ltx-video"),
            raw_shards,
            tmp_path / name,
            str(kept_window),
            window={"size": "keep"},
            train={"epochs": 2, "checkpoint_every": 3, "batch_size": 3, "max_steps": 9},
            caption_dropout={"rate": 0.3},
        )  # dropout is drawn per (seed, step, sample): exact too

    reference = start("train", config("reference"), log=tmp_path / "reference.log")
    finish(reference, tmp_path / "reference.log")

    killed = start(
        "train", config("resumed"), log=tmp_path / "killed.log", env={"VT_FAULT_AT": "train.after_checkpoint@2"}
    )  # dies right after the step-6 checkpoint
    assert killed.wait(timeout=300) == -9
    checkpoints = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert checkpoints[-1] == "step-000006"
    assert not (tmp_path / "resumed" / "lora").exists()

    resumed = start("train", config("resumed"), log=tmp_path / "resumed.log")
    finish(resumed, tmp_path / "resumed.log")
    assert "resumed from" in (tmp_path / "resumed.log").read_text()

    expected, got = losses(tmp_path / "reference"), losses(tmp_path / "resumed")
    assert sorted(expected) == list(range(1, 10))
    assert got == pytest.approx(expected, rel=1e-6, abs=0)
