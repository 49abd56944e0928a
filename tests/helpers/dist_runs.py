"""Helpers for multi-process tests: launch `vt-train` ranks as torchrun does, read what the runs left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers.forkserver import BASE_ENV, Forked, launch, launch_ranks
from helpers.forkserver import free_port as free_port  # the tests' one way to pick a port

BIN = Path(sys.executable).parent


def child_env(extra: dict | None = None) -> dict:
    return {**os.environ, **BASE_ENV, **(extra or {})}


def torchrun(
    config: Path,
    nproc: int,
    *overrides: str,
    log: Path,
    env: dict | None = None,
    nnodes: int = 1,
    endpoint: str | None = None,
    script: Path | None = None,
):
    """The ranks of `torchrun ... vt-train run CONFIG --set ...`; `script`: a Python file taking vt-train's
    arguments, in place of vt-train. One node: the ranks are forked from the warm interpreter of
    tests/helpers/forkserver.py with torchrun's environment (a Popen-like group); one of `nnodes` nodes: the real
    torchrun with c10d rendezvous (its own processes, as test_multinode wants)."""
    args = ["run", str(config)]
    for text in overrides:
        args += ["--set", text]
    entry = str(script) if script else "vt-train"
    if nnodes == 1:
        return launch_ranks(entry, nproc, *args, log=log, env=child_env(env))
    launch = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=vt-test",
    ]
    command = [str(BIN / "torchrun"), *launch, *([str(script)] if script else ["-m", "vt.train"]), *args]
    return subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=child_env(env))


def single(config: Path, *overrides: str, log: Path, env: dict | None = None) -> Forked:
    """One plain process (`vt-train run`), no torchrun: the reference layout (forked, tests/helpers/forkserver.py)."""
    args = ["run", str(config)]
    for text in overrides:
        args += ["--set", text]
    return launch("vt-train", *args, env=child_env(env), log=log)


def finish(proc, log: Path, timeout: float = 300) -> None:
    code = proc.wait(timeout=timeout)
    if code != 0:
        raise AssertionError(f"{' '.join(map(str, proc.args[:6]))} ... exited with {code}:\n{log.read_text()[-6000:]}")


def kill_and_resume(config: Path, fault: str, folder: Path) -> None:
    """One process of `config` killed (SIGKILL) at fault point `fault` (`point@count`), then started again to the
    end; the second start must have resumed from a checkpoint."""
    log = folder / "killed.log"
    killed = single(config, log=log, env={"VT_FAULT_AT": fault})
    assert killed.wait(timeout=300) == -9, log.read_text()[-3000:]
    log = folder / "resumed.log"
    finish(single(config, log=log), log)
    assert "resumed from" in log.read_text()


def losses(run_dir: Path) -> dict[int, float]:
    """step -> logged loss (a step logged twice, by a killed run and its resume: the last wins)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[record["step"]] = record["loss"]
    return out


def trained_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The exported trainable weights: the LoRA files (keys prefixed by their file's name, so several
    experts' files do not overwrite each other), or the full model's safetensors."""
    from safetensors.torch import load_file

    files = sorted((run_dir / "lora").glob("*.safetensors")) or sorted((run_dir / "model").glob("*.safetensors"))
    if not files:
        raise AssertionError(f"{run_dir} has no exported weights (lora/ or model/)")
    weights = {}
    for file in files:
        prefix = f"{file.name}:" if file.parent.name == "lora" else ""
        weights.update({prefix + key: tensor for key, tensor in load_file(file).items()})
    return weights


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sample_log(run_dir: Path) -> list[dict]:
    """Every rank's samples/rank*.jsonl lines (step, micro, keys, bucket, dp_rank, mesh coordinates)."""
    entries = []
    for path in sorted((run_dir / "samples").glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        entries += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines() if line.strip()]
    return entries


def assert_same_training(
    run_dir: Path, reference_dir: Path, rel: float = 1e-4, weights_rel: float | None = None
) -> None:
    """Losses (and audio losses) and gradient norms per step, and the exported trainable weights, match the
    reference (the weights within `weights_rel`, default `rel`)."""
    import pytest

    from vt.train.trackers import read_metrics

    expected = {m["step"]: m for m in read_metrics(reference_dir / "metrics.jsonl")}
    got = {m["step"]: m for m in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4], f"steps {sorted(got)} vs {sorted(expected)}"
    for step in expected:
        assert got[step]["batch"] == expected[step]["batch"], f"step {step} trained a different global batch"
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=rel), f"loss at step {step}"
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=rel), f"grad norm at {step}"
        if "audio_loss" in expected[step]:  # model.audio: the audio stream's share, all-reduced like the loss
            assert got[step]["audio_loss"] == pytest.approx(expected[step]["audio_loss"], rel=rel), f"audio at {step}"
    for sub in ("", "ema"):  # the weights, and with ema.decay their average (<run.dir>/ema/)
        if sub and not (reference_dir / sub).is_dir():
            continue
        weights, reference = trained_weights(run_dir / sub), trained_weights(reference_dir / sub)
        assert weights.keys() == reference.keys()
        worst = max((relative_difference(weights[k], reference[k]), k) for k in reference)
        assert worst[0] <= (weights_rel or rel), (
            f"{sub or 'trained'} weights differ from the single-process run: {worst}"
        )
