"""[lr_schedule] (train/parts/lr_schedule.py): a linear warm-up, then the rate kept, or decayed to `min_ratio` x
train.lr at train.max_steps linearly or along a cosine; the rate each step applied is the one metrics.jsonl logs, and
a resumed run continues the same curve (the scheduler is in the checkpoint)."""

from __future__ import annotations

import math

import pytest

from vt.shared.config import load_config
from vt.shared.errors import UserError
from vt.train.parts.lr_schedule import lr_factor
from vt.train.trackers import read_metrics

from helpers.cli_runs import write_config


def test_the_factor_warms_up_then_decays_to_the_floor():
    assert [lr_factor(s, 2, "constant", 10, 0.0) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 2, "linear", 10, 0.0) == 1.0 and lr_factor(6, 2, "linear", 10, 0.0) == 0.5
    assert lr_factor(10, 2, "linear", 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(6, 2, "cosine", 10, 0.0) == pytest.approx(0.5)  # half way: cos(pi / 2)
    assert lr_factor(4, 2, "cosine", 10, 0.2) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(99, 0, "cosine", 10, 0.2) == pytest.approx(0.2)  # past the end: the floor


def run(tmp_path, tiny_model_factory, raw_shards, window, name: str, max_steps: int, **schedule) -> list[float]:
    from vt.train.trainer import Trainer

    config = write_config(
        tmp_path / f"{name}.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run" if name != "whole" else tmp_path / "whole",
        str(window),
        window={"size": "keep"},
        train={"batch_size": 1, "epochs": 100, "max_steps": max_steps, "checkpoint_every": 2, "lr": 1e-3},
        lr_schedule=schedule,
    )
    Trainer(load_config(config)).run()
    return [
        record["lr"] for record in read_metrics(tmp_path / ("whole" if name == "whole" else "run") / "metrics.jsonl")
    ]


def test_a_run_applies_the_curve_and_a_resume_continues_it(tmp_path, tiny_model_factory, raw_shards, kept_window):
    schedule = {"warmup_steps": 1, "decay": "cosine", "min_ratio": 0.1}
    whole = run(tmp_path, tiny_model_factory, raw_shards, kept_window, "whole", 5, **schedule)
    assert whole == pytest.approx([1e-3 * lr_factor(s, 1, "cosine", 5, 0.1) for s in range(5)])
    assert whole[0] == pytest.approx(1e-3) and whole[-1] < whole[1]
    # Two steps, then the same config for five: the resumed run starts from step 2's checkpoint, on the same curve.
    first = run(tmp_path, tiny_model_factory, raw_shards, kept_window, "first", 2, **schedule)
    with pytest.raises(UserError, match="lr_schedule.decay = 'cosine' decays to the run's last step"):
        run(tmp_path, tiny_model_factory, raw_shards, kept_window, "open", 0, **schedule)
    resumed = run(tmp_path, tiny_model_factory, raw_shards, kept_window, "resumed", 5, **schedule)
    assert first == pytest.approx(whole[:2]) and resumed == pytest.approx(whole)
