"""A training step reads one value back to the host, whether its loss and gradient norm are finite, before the
optimizer applies it (issue 26; issue 17 kept everything on the device and stopped on a NaN only at the next log,
after the optimizer had applied it): the metrics stay on the device until a step is logged.

On the CPU a read costs nothing, so the tests count the calls that would wait for a GPU (`item`, `tolist`,
`cpu`, `float()`, `bool()` of a tensor) made from the trainer's loop and the gradient clipping, per step.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from vt.shared.config import load_config
from vt.train.trackers import read_metrics

from helpers.cli_runs import write_config

WATCHED = tuple(
    str(Path("train") / name) for name in ("trainer.py", "run_stats.py", str(Path("parallel") / "grads.py"))
)
READS = ("item", "tolist", "cpu", "__float__", "__bool__")


def trainer_for(tmp_path, tiny_model_factory, raw_shards, window, **train):
    from vt.train.trainer import Trainer

    settings = {"batch_size": 1, "epochs": 100, "max_steps": 8, "checkpoint_every": 0, **train}
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run",
        str(window),
        window={"size": "keep"},
        train=settings,
        log={"every_steps": 4},
    )
    return Trainer(load_config(config))


def count_host_reads(monkeypatch, trainer) -> Counter:
    """step -> host reads of tensors made directly by train/trainer.py, run_stats.py or parallel/grads.py while
    `trainer.step` was that step (a read after step N's train_step, e.g. its logging, counts for N)."""
    reads: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(WATCHED):
                reads[trainer.step] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    return reads


def test_only_logged_steps_read_the_device(tmp_path, tiny_model_factory, raw_shards, kept_window, monkeypatch):
    trainer = trainer_for(tmp_path, tiny_model_factory, raw_shards, kept_window)
    reads = count_host_reads(monkeypatch, trainer)
    trainer.run()
    monkeypatch.undo()
    assert trainer.step == 8
    unlogged = {step: reads[step] for step in range(8) if step != 4}
    assert unlogged == dict.fromkeys(unlogged, 1), f"more than the finiteness check on steps not logged: {unlogged}"
    assert reads[4] == 2  # step 5's check, and step 4's metrics
    assert reads[8] == 1  # step 8's metrics (its check counted for step 7)
    records = {m["step"]: m for m in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert sorted(records) == [4, 8]
    for record in records.values():
        assert all(math.isfinite(record[key]) for key in ("loss", "grad_norm", "peak_mem_gb/rank0"))
        assert record["peak_mem_gb/rank0"] > 0


@pytest.mark.parametrize("checkpoint_every", [2, 3])
def test_a_nan_loss_stops_the_run_before_the_optimizer_applies_it(
    tmp_path, tiny_model_factory, raw_shards, kept_window, monkeypatch, checkpoint_every
):
    """A NaN loss at step 3 stops the run at step 3, on the host read before the optimizer: the weights stay step
    2's, no checkpoint of step 3 (or later) is written, nothing is exported."""
    from vt.train import step as step_module  # the step's loss path (train/step.py)

    trainer = trainer_for(tmp_path, tiny_model_factory, raw_shards, kept_window, checkpoint_every=checkpoint_every)
    joint_loss = step_module.joint_loss
    before = {}

    def nan_at_step_3(*args, **kwargs):
        loss, audio_loss = joint_loss(*args, **kwargs)
        if trainer.step == 2:  # trainer.step counts from 0: step 3 is running
            before.update({n: p.detach().clone() for n, p in trainer.transformer.named_parameters() if p.requires_grad})
            loss = loss * math.nan
        return loss, audio_loss

    monkeypatch.setattr(step_module, "joint_loss", nan_at_step_3)
    with pytest.raises(FloatingPointError, match="loss is nan at step 3, which the optimizer did not apply"):
        trainer.run()
    assert trainer.step == 2 and before
    after = dict(trainer.transformer.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert checkpoints == (["step-000002"] if checkpoint_every == 2 else [])
    assert not (tmp_path / "run" / "lora").exists()


def test_a_time_interval_logs_every_step_it_is_due(tmp_path, tiny_model_factory, raw_shards, kept_window):
    """log.every_seconds: rank 0's tracker decides (broadcast to the others in a distributed run); an interval
    shorter than a step logs every step, well before log.every_steps."""
    from vt.train.trainer import Trainer

    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run",
        str(kept_window),
        window={"size": "keep"},
        train={"batch_size": 1, "epochs": 100, "max_steps": 3, "checkpoint_every": 0},
        log={"every_steps": 100, "every_seconds": 1e-6},
    )
    Trainer(load_config(config)).run()
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
