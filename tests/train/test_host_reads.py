"""A training step reads nothing back to the host (issue 17): losses, the gradient norm and the NaN check stay
on the device until a step is logged, so the host can queue the next step while the GPU runs this one.

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
from cli_runs import write_config

from vt.shared.config import load_config
from vt.train.trackers import read_metrics

WATCHED = tuple(str(Path("train") / name) for name in ("trainer.py", str(Path("parallel") / "grads.py")))
READS = ("item", "tolist", "cpu", "__float__", "__bool__")


@pytest.fixture(scope="module")
def kept_window(tmp_path_factory, tiny_model_factory, raw_shards):
    """A precomputed 'keep' window the runs below re-read (precompute once, train many times)."""
    from vt.precompute.service import Precompute

    root = tmp_path_factory.mktemp("reads")
    config = write_config(root / "pre.toml", tiny_model_factory("ltx-video"), raw_shards, root / "pre",
                          str(root / "window"), window={"size": "keep"}, precompute={"workers": 0})
    Precompute(load_config(config)).run()
    return root / "window"


def trainer_for(tmp_path, tiny_model_factory, raw_shards, window, **train):
    from vt.train.trainer import Trainer

    settings = {"batch_size": 1, "epochs": 100, "max_steps": 8, "checkpoint_every": 0, **train}
    config = write_config(tmp_path / "run.toml", tiny_model_factory("ltx-video"), raw_shards, tmp_path / "run",
                          str(window), window={"size": "keep"}, train=settings, log={"every_steps": 4})
    return Trainer(load_config(config))


def count_host_reads(monkeypatch, trainer) -> Counter:
    """step -> host reads of tensors made directly by train/trainer.py or train/parallel/grads.py while
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
    unlogged = {step: reads[step] for step in range(9) if step not in (4, 8)}
    assert unlogged == dict.fromkeys(unlogged, 0), f"host reads on steps that are not logged: {unlogged}"
    assert 0 < reads[4] <= 2  # the NaN check and the metrics, one read each
    assert 0 < reads[8] <= 3  # the same, and the check before the final checkpoint
    records = {m["step"]: m for m in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert sorted(records) == [4, 8]
    for record in records.values():
        assert all(math.isfinite(record[key]) for key in ("loss", "grad_norm", "peak_mem_gb/rank0"))
        assert record["peak_mem_gb/rank0"] > 0


@pytest.mark.parametrize("checkpoint_every, stops_at", [(3, "a checkpoint"), (2, "the next log")],
                         ids=["checkpoint", "log"])
def test_a_nan_loss_stops_the_run_before_any_later_checkpoint(tmp_path, tiny_model_factory, raw_shards, kept_window,
                                                               monkeypatch, checkpoint_every, stops_at):
    """A NaN loss at step 3 is not read at its step: the run stops at the next check, which comes at
    step 3's checkpoint or at the step-4 log, naming step 3, and no checkpoint after step 2 is written."""
    from vt.train import trainer as trainer_module

    trainer = trainer_for(tmp_path, tiny_model_factory, raw_shards, kept_window, checkpoint_every=checkpoint_every)
    joint_loss = trainer_module.joint_loss

    def nan_at_step_3(*args, **kwargs):
        loss, audio_loss = joint_loss(*args, **kwargs)
        return (loss * math.nan if trainer.step == 2 else loss), audio_loss  # trainer.step counts from 0

    monkeypatch.setattr(trainer_module, "joint_loss", nan_at_step_3)
    with pytest.raises(FloatingPointError, match="loss is nan at step 3;"):
        trainer.run()
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert checkpoints == (["step-000002"] if checkpoint_every == 2 else []), stops_at
    assert trainer.step == (3 if checkpoint_every == 3 else 4)
    assert not (tmp_path / "run" / "lora").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()  # step 4 was not logged


def test_a_time_interval_logs_every_step_it_is_due(tmp_path, tiny_model_factory, raw_shards, kept_window):
    """log.every_seconds: rank 0's tracker decides (broadcast to the others in a distributed run); an interval
    shorter than a step logs every step, well before log.every_steps."""
    from vt.train.trainer import Trainer

    config = write_config(tmp_path / "run.toml", tiny_model_factory("ltx-video"), raw_shards, tmp_path / "run",
                          str(kept_window), window={"size": "keep"},
                          train={"batch_size": 1, "epochs": 100, "max_steps": 3, "checkpoint_every": 0},
                          log={"every_steps": 100, "every_seconds": 1e-6})
    Trainer(load_config(config)).run()
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
