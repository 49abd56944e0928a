"""`guidance.scale` in a real run (tiny LTX-Video, one kept window): w = 1 trains the losses of a run without it,
w = 3 other losses from the first step on (its targets are u + 3 (target - u), u the base on the empty caption)."""

from __future__ import annotations

import pytest

from vt.shared.config import load_config
from vt.train.trackers import read_metrics

from helpers.cli_runs import write_config


def losses(tmp_path, name, folder, raw, window, **sections) -> list[float]:
    from vt.train.trainer import Trainer

    settings = {"batch_size": 2, "max_steps": 2, "checkpoint_every": 0}
    config = write_config(
        tmp_path / f"{name}.toml",
        folder,
        raw,
        tmp_path / name,
        str(window),
        buckets={"sizes": ["9x64x64"], "fps": 8.0},
        window={"size": "keep"},
        train=settings,
        **sections,
    )
    Trainer(load_config(config)).run()
    return [record["loss"] for record in read_metrics(tmp_path / name / "metrics.jsonl")]


def test_scale_one_trains_plain_flow_matching_and_scale_three_other_targets(tmp_path, tiny_model_factory, raw_shards):
    from vt.precompute.service import Precompute

    folder = tiny_model_factory("ltx-video")
    config = write_config(
        tmp_path / "pre.toml",
        folder,
        raw_shards,
        tmp_path / "pre",
        str(tmp_path / "window"),
        buckets={"sizes": ["9x64x64"], "fps": 8.0},
        window={"size": "keep"},
        precompute={"workers": 0},
    )
    Precompute(load_config(config)).run()
    window = tmp_path / "window"
    plain = losses(tmp_path, "plain", folder, raw_shards, window)
    same = losses(tmp_path, "one", folder, raw_shards, window, guidance={"scale": 1.0})
    guided = losses(tmp_path, "three", folder, raw_shards, window, guidance={"scale": 3.0})
    assert len(plain) == 2
    assert same == pytest.approx(plain, rel=1e-6, abs=1e-6)
    assert all(abs(a - b) > 1e-4 for a, b in zip(guided, plain))  # the first step's loss already differs
