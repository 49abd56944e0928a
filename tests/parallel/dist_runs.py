"""Helpers for multi-process tests: launch `vt.train` under torchrun, read what the runs left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(extra: dict | None = None) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONFAULTHANDLER": "1",
            **(extra or {})}


def torchrun(config: Path, nproc: int, *overrides: str, log: Path, env: dict | None = None,
             nnodes: int = 1, endpoint: str | None = None, script: Path | None = None) -> subprocess.Popen:
    """Start `torchrun ... -m vt.train run CONFIG --set ...` (one node, or one of `nnodes` nodes); `script`:
    a Python file taking vt-train's arguments, in place of `-m vt.train`."""
    if nnodes == 1:
        launch = ["--standalone", f"--nproc-per-node={nproc}"]
    else:
        launch = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={endpoint}", "--rdzv-id=vt-test"]
    entry = [str(script)] if script else ["-m", "vt.train"]
    args = [str(BIN / "torchrun"), *launch, *entry, "run", str(config)]
    for text in overrides:
        args += ["--set", text]
    return subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=child_env(env))


def single(config: Path, *overrides: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    """One plain process (`vt-train run`), no torchrun: the reference layout."""
    args = [str(BIN / "vt-train"), "run", str(config)]
    for text in overrides:
        args += ["--set", text]
    return subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=child_env(env))


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    code = proc.wait(timeout=timeout)
    if code != 0:
        raise AssertionError(f"{' '.join(map(str, proc.args[:6]))} ... exited with {code}:\n{log.read_text()[-6000:]}")


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


def assert_same_training(run_dir: Path, reference_dir: Path, rel: float = 1e-4) -> None:
    """Losses and gradient norms per step, and the exported trainable weights, match the reference."""
    import pytest

    from vt.train.trackers import read_metrics

    expected = {m["step"]: m for m in read_metrics(reference_dir / "metrics.jsonl")}
    got = {m["step"]: m for m in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4], f"steps {sorted(got)} vs {sorted(expected)}"
    for step in expected:
        assert got[step]["batch"] == expected[step]["batch"], f"step {step} trained a different global batch"
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=rel), f"loss at step {step}"
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=rel), f"grad norm at {step}"
    weights, reference = trained_weights(run_dir), trained_weights(reference_dir)
    assert weights.keys() == reference.keys()
    worst = max((relative_difference(weights[k], reference[k]), k) for k in reference)
    assert worst[0] <= rel, f"trained weights differ from the single-process run: {worst}"
