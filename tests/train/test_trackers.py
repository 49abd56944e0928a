"""Tracker sinks (JSONL, TensorBoard, wandb offline), rate limiting, the loss plot, the progress bar."""

from __future__ import annotations

import json
import os
import struct
import sys
from unittest.mock import ANY

import pytest

from vt.shared.progress import Progress
from vt.train.plots import moving_average, plot_loss
from vt.train.trackers import Tracker, read_metrics


class FakeClock:
    """A clock the test moves by hand, so time-based rate limiting needs no sleep."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_jsonl_lines_hold_step_time_and_values(tmp_path):
    with Tracker(tmp_path / "run") as tracker:
        assert tracker.log(1, {"loss": 0.5, "lr": 1e-4, "samples": 8})
        # A crash right now must keep the line: it is flushed before log() returns.
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 1
        tracker.log(2, {"loss": 0.25})
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == 0.5 and records[0]["lr"] == 1e-4 and records[0]["samples"] == 8
    assert isinstance(records[0]["samples"], int)
    assert records[1] == {"step": 2, "time": records[1]["time"], "loss": 0.25}
    assert records[0]["time"] > 1.6e9  # wall-clock seconds, comparable across resumed runs


def test_tensor_values_become_numbers_and_bad_values_are_rejected(tmp_path):
    import torch

    with Tracker(tmp_path) as tracker:
        tracker.log(1, {"loss": torch.tensor(0.75), "grad_norm": float("nan")})
        with pytest.raises(TypeError, match="'note' must be a number"):
            tracker.log(2, {"note": "hello"})
        with pytest.raises(ValueError, match="reserved"):
            tracker.log(3, {"step": 3.0})
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["loss"] == 0.75
    assert record["grad_norm"] != record["grad_norm"]  # NaN is logged, not hidden


def test_every_steps_rate_limit(tmp_path):
    with Tracker(tmp_path, every_steps=5) as tracker:
        logged = [step for step in range(1, 21) if tracker.log(step, {"loss": float(step)})]
    assert logged == [5, 10, 15, 20]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [5, 10, 15, 20]


def test_every_seconds_rate_limit_with_fake_clock(tmp_path):
    clock = FakeClock()
    with Tracker(tmp_path, every_steps=0, every_seconds=10.0, clock=clock) as tracker:
        assert not tracker.due(1)
        clock.now += 9.9
        assert not tracker.log(1, {"loss": 1.0})
        clock.now += 0.1  # 10 s since the tracker started
        assert tracker.log(2, {"loss": 2.0})
        clock.now += 5
        assert not tracker.log(3, {"loss": 3.0})  # only 5 s since the last log
        clock.now += 5
        assert tracker.log(4, {"loss": 4.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2, 4]


def test_steps_or_seconds_whichever_comes_first(tmp_path):
    clock = FakeClock()
    with Tracker(tmp_path, every_steps=100, every_seconds=60.0, clock=clock) as tracker:
        assert not tracker.log(7, {"loss": 1.0})
        clock.now += 60
        assert tracker.log(8, {"loss": 1.0})  # by time
        assert not tracker.log(9, {"loss": 1.0})
        assert tracker.log(100, {"loss": 1.0})  # by steps, although only 0 s passed


def test_force_always_logs(tmp_path):
    with Tracker(tmp_path, every_steps=1000, clock=FakeClock()) as tracker:
        assert not tracker.due(3)
        assert tracker.log(3, {"val_loss": 0.1}, force=True)
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["val_loss"] == 0.1


def test_disabled_tracker_does_nothing(tmp_path):
    tracker = Tracker(tmp_path / "rank1", enabled=False, tensorboard=True, wandb=True)
    assert not tracker.due(1)
    assert not tracker.log(1, {"loss": 1.0}, force=True)
    tracker.close()
    assert not (tmp_path / "rank1").exists()


def test_no_interval_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="log.every_steps=1"):
        Tracker(tmp_path, every_steps=0, every_seconds=0.0)


def test_read_metrics_skips_torn_last_line_and_resume_cuts_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 1.0, "loss": 1.0}\n{"step": 2, "time": 2.0, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1]
    # A resumed run appends to the same file: the torn tail is cut so every line parses.
    with Tracker(tmp_path) as tracker:
        tracker.log(2, {"loss": 0.5})
    assert path.read_text().count("\n") == 2
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0), (2, 0.5)]


def test_read_metrics_names_a_broken_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError, match="logged anything"):
        read_metrics(tmp_path / "missing.jsonl")


def test_tensorboard_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(tmp_path, tensorboard=True, config={"train": {"lr": 1e-4}}) as tracker:
        tracker.log(1, {"loss": 0.5})
        tracker.log(2, {"loss": 0.25})
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]


@pytest.fixture
def own_wandb_service():
    """wandb starts one service per process and names it in os.environ (WANDB_SERVICE), which every
    process the tests start later would inherit and share: a killed trainer's run id then stays taken in
    it. Shut this test's service down and take the variable back."""
    yield
    import wandb

    wandb.teardown()
    os.environ.pop("WANDB_SERVICE", None)


def test_wandb_offline_run_creates_its_folder(tmp_path, monkeypatch, own_wandb_service):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    with Tracker(run_dir, wandb=True, config={"train": {"lr": 1e-4}}) as tracker:
        tracker.log(1, {"loss": 0.5})
        tracker.log(3, {"loss": 0.4})
        tracker.log_records([(1, {"val/prompt/00": 0.25})])  # a validation's metrics, done after later steps
    assert read_metrics(run_dir / "metrics.jsonl")[-1] == {"step": 1, "time": ANY, "val/prompt/00": 0.25}
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    runs = list((tmp_path / "wandb_home" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    assert (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    assert (run_dir / "metrics.jsonl").exists()  # the JSONL sink is on whatever else is
    # A resumed run in the same folder continues the same wandb run id.
    with Tracker(run_dir, wandb=True) as tracker:
        tracker.log(2, {"loss": 0.25})
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    assert len(list((tmp_path / "wandb_home" / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1


def test_missing_wandb_package_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb.*log.wandb=false"):
        Tracker(tmp_path, wandb=True)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def test_plot_loss_writes_png_of_expected_size(tmp_path):
    run_dir = tmp_path / "my-run"
    with Tracker(run_dir) as tracker:
        for step in range(1, 61):
            tracker.log(step, {"loss": 1.0 / step, "lr": 1e-4 * min(1.0, step / 10)})
        tracker.log(60, {"val_loss": 0.3}, force=True)  # a record without loss is skipped
    out = plot_loss(run_dir / "metrics.jsonl", tmp_path / "plots" / "loss.png", smooth=5)
    assert out == tmp_path / "plots" / "loss.png"
    assert out.stat().st_size > 5000
    assert _png_size(out) == (800, 450)


def test_plot_loss_without_loss_is_a_clear_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "time": 0.0, "lr": 1e-4}) + "\n")
    with pytest.raises(ValueError, match="no 'loss' records"):
        plot_loss(path, tmp_path / "loss.png")


def test_moving_average():
    assert moving_average([1, 2, 3, 4, 5], 2).tolist() == [1.5, 2.5, 3.5, 4.5]
    assert moving_average([1, 2, 3], 3).tolist() == [2.0]


def test_progress_bar_shows_desc_count_and_postfix(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with Progress(total=4, desc="train") as bar:
        for _ in range(4):
            bar.update(1, loss=0.123456, samples_s=40.0)
    err = capsys.readouterr().err
    assert "train" in err and "4/4" in err
    assert "loss=0.1235" in err and "samples_s=40" in err


def test_progress_bar_is_silent_on_other_ranks_and_when_disabled(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with Progress(total=3, desc="rank1") as bar:
        bar.update(3, loss=1.0)
    monkeypatch.setenv("RANK", "0")
    with Progress(total=3, desc="off", enabled=False) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
