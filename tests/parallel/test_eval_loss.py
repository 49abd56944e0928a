"""The held-out loss (train/parts/held_out.py): the same number in one process, DDP(2), FSDP2(2) and over two pipeline
stages, and after a kill and a resume, for the same weights.

The real sample clips' raw shards split in two: the last one is `data.eval`, which vt-precompute encodes into the
window's `eval/` prefix, the others train (Wan's tiny preset, LoRA). Every step is evaluated, at three sigmas.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vt.shared.config import load_config
from vt.train.trackers import read_metrics

from helpers.dist_runs import finish, kill_and_resume, single, torchrun

SIGMAS = [0.2, 0.5, 0.8]
KEYS = ["eval_loss", *(f"eval_loss/sigma_{s:g}" for s in SIGMAS)]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory, tiny_model_factory, raw_shards):
    """(config maker, model): a kept window of the training shards with the held-out shard under its eval/ prefix."""
    from vt.precompute.service import run_stage1

    from helpers.cli_runs import write_config

    root = tmp_path_factory.mktemp("held-out")
    tars = sorted(raw_shards.glob("*.tar"))
    for folder, picked in (("train-raw", tars[:-1]), ("eval-raw", tars[-1:])):
        (root / folder).mkdir()
        for tar in picked:
            shutil.copy(tar, root / folder / tar.name)
    model = tiny_model_factory("wan")

    def config(folder: Path, name: str, **sections) -> Path:
        return write_config(
            folder / f"{name}.toml",
            model,
            root / "train-raw",
            folder / name,
            str(root / "window"),
            model={"family": "wan", "max_text_tokens": 64},
            buckets={"sizes": ["9x64x64"]},
            window={"size": "keep"},
            data={"eval": str(root / "eval-raw")},
            precompute={"workers": 0},
            train={
                "batch_size": 4,
                "lr": 1e-3,
                "epochs": 1,
                "checkpoint_every": 1,
            },
            held_out={"every": 1, "sigmas": SIGMAS},
            log={"progress": False},
            **sections,
        )

    report = run_stage1(load_config(config(root, "pre")))
    assert report.status == "done"
    return config


def evaluations(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> its held-out metrics (a step logged twice, by a killed run and its resume: the last wins)."""
    return {m["step"]: {k: m[k] for k in KEYS} for m in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in m}


@pytest.mark.xdist_group("eval-loss")
def test_the_held_out_loss_is_the_same_at_every_layout_and_after_a_resume(tmp_path, held_out):
    log = tmp_path / "reference.log"
    finish(single(held_out(tmp_path, "reference"), log=log), log)
    expected = evaluations(tmp_path / "reference")
    steps = sorted(expected)
    last = max(m["step"] for m in read_metrics(tmp_path / "reference" / "metrics.jsonl"))
    assert len(steps) >= 2 and steps[-1] == last  # every step, the last one too
    assert all(0 < value < 100 for metrics in expected.values() for value in metrics.values())
    assert len({round(v, 6) for v in expected[steps[0]].values()}) == len(KEYS), "each sigma its own number"
    for name, overrides in (
        ("ddp-2", ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        ("fsdp-2", ["parallel.dp_shard=2"]),
        ("pp-2", ["parallel.pp=2", "parallel.dp_shard=1"]),
    ):
        log = tmp_path / f"{name}.log"
        finish(torchrun(held_out(tmp_path, name), 2, *overrides, log=log), log)
        got = evaluations(tmp_path / name)
        assert sorted(got) == steps, name
        for step in steps:
            assert got[step] == pytest.approx(expected[step], rel=1e-5), (name, step)

    kill_and_resume(held_out(tmp_path, "resumed"), "train.after_checkpoint@1", tmp_path)  # after step 1's checkpoint
    got = evaluations(tmp_path / "resumed")
    assert sorted(got) == steps
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), ("resumed", step)


@pytest.mark.xdist_group("eval-loss")
def test_the_held_out_loss_of_the_average_is_asked_for_with_ema_eval(tmp_path, held_out):
    """ema.eval: the held-out loss is the weights' average's. An average that barely averages (decay 1e-9)
    gives the trained weights' numbers; a slow one (0.9) others."""
    runs = {"plain": {}, "near": {"decay": 1e-9, "eval": True}, "slow": {"decay": 0.9, "eval": True}}
    got = {}
    for name, ema in runs.items():
        log = tmp_path / f"{name}.log"
        finish(single(held_out(tmp_path, name, **({"ema": ema} if ema else {})), log=log), log)
        got[name] = evaluations(tmp_path / name)
    last = max(got["plain"])
    assert got["near"][last] == pytest.approx(got["plain"][last], rel=1e-5)
    assert got["slow"][last]["eval_loss"] != pytest.approx(got["plain"][last]["eval_loss"], rel=1e-4)
