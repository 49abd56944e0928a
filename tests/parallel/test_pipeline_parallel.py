"""Pipeline parallel (train/parallel/pp.py) trains the same model as one process: PP (2), PP (2) x FSDP2 (2)
and PP (2) x TP (2), with the GPipe and the 1F1B schedule, on Wan (LoRA, clipped every step) and LTX-Video
(full fine-tune), over gloo; and a PP (2) checkpoint resumes in one process.

Every run is real rank processes (tests/helpers/dist_runs.py) compared against the family's one-process
reference (conftest.py): per-step losses and gradient norms, and the exported trainable weights, to 1e-4.
"""

from __future__ import annotations

import pytest

from vt.train.parallel.dims import ParallelDims

from helpers.cli_runs import raw_keys
from helpers.dist_runs import assert_same_training, finish, losses, single, torchrun
from helpers.slice_audit import check_slices

LAYOUTS = {
    "pp-2": (2, ["parallel.dp_shard=1", "parallel.pp=2"]),
    "pp-fsdp-2x2": (4, ["parallel.pp=2", "parallel.dp_shard=2"]),
    "pp-tp-2x2": (4, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.tp=2"]),
}
EXPECTED_LOG = {
    "pp-2": "world 2 = pp 2 x dp_replicate 1 x dp_shard 1",
    "pp-fsdp-2x2": "world 4 = pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1 (FSDP2)",
    "pp-tp-2x2": "world 4 = pp 2 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 2",
}
# Each family runs each layout once, the schedules alternating between them.
CASES = [
    ("wan", "pp-2", "gpipe"),
    ("wan", "pp-fsdp-2x2", "1f1b"),
    ("wan", "pp-tp-2x2", "gpipe"),
    ("ltx-video", "pp-2", "1f1b"),
    ("ltx-video", "pp-fsdp-2x2", "gpipe"),
    ("ltx-video", "pp-tp-2x2", "1f1b"),
]


@pytest.mark.parametrize(
    "family, layout, schedule",
    [
        pytest.param(f, layout, s, id=f"{layout}-{s}-{f}", marks=pytest.mark.xdist_group(f"parity-{f}"))
        for f, layout, s in CASES
    ],
)
def test_pipeline_matches_one_process(tmp_path, run_config, reference, raw_shards, family, layout, schedule):
    nproc, overrides = LAYOUTS[layout]
    config = run_config(tmp_path, family, layout)
    log = tmp_path / "run.log"
    finish(torchrun(config, nproc, *overrides, f"parallel.pp_schedule={schedule}", log=log), log)

    assert_same_training(tmp_path / layout, reference(family))
    degrees = dict(o.removeprefix("parallel.").split("=") for o in overrides)
    dims = ParallelDims(**{k: int(v) for k, v in degrees.items()}, world_size=nproc)
    trained = check_slices(tmp_path / layout, dims)  # pp peers train on the same slice, like cp/tp peers
    assert set(trained) == raw_keys(raw_shards) and set(trained.values()) == {1}, "every sample once in the epoch"
    assert EXPECTED_LOG[layout] in log.read_text()


def test_pipeline_checkpoint_resumes_in_one_process(tmp_path, run_config, reference):
    """A PP (2) run killed after its step-2 checkpoint continues at pp = 1 exactly as the uninterrupted run."""
    config = run_config(tmp_path, "wan", "run")
    killed = torchrun(
        config,
        2,
        "parallel.dp_shard=1",
        "parallel.pp=2",
        log=tmp_path / "killed.log",
        env={"VT_FAULT_AT": "train.after_checkpoint@1"},
    )
    assert killed.wait(timeout=300) != 0
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
    assert sorted(losses(run_dir)) == [1, 2]

    finish(single(config, log=tmp_path / "resumed.log"), tmp_path / "resumed.log")
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    assert_same_training(run_dir, reference("wan"))  # steps 1-2 from two stages, 3-4 from one process


def test_pipeline_refuses_sound_and_several_experts():
    """model.audio and all-experts runs stop at start-up with pp > 1, saying what to set (no processes needed:
    the check reads the config and the spec only)."""
    from types import SimpleNamespace

    from vt.train.refusals import check_pipeline_stages  # what the trainer and `vt-train plan` check at start-up

    def check(audio: bool, experts: dict):
        config = SimpleNamespace(parallel=SimpleNamespace(pp=2), model=SimpleNamespace(audio=audio))
        check_pipeline_stages(config, SimpleNamespace(trained_experts=experts, pipeline_refusal=""))

    with pytest.raises(ValueError, match="set parallel.pp = 1 to train sound"):
        check(True, {})
    with pytest.raises(ValueError, match="train one expert per run"):
        check(False, {"high_noise": "transformer", "low_noise": "transformer_2"})
    check(False, {})  # video alone, one transformer: runs
