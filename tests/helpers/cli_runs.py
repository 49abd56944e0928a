"""Helpers for tests that run the real CLIs as processes: run configs, start/finish, raw keys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers.forkserver import Forked, launch

BIN = Path(sys.executable).parent


def raw_keys(raw: Path) -> set[str]:
    """The keys the samples of the raw shards at `raw` get in latent shards and trainer logs
    (`<raw shard name>/<key>`, named over the whole shard list as the service names them)."""
    from vt.precompute.sources import iter_raw_samples, list_raw_shards, shard_names

    shards = list_raw_shards(str(raw))
    names = shard_names(shards)
    return {s.sample_id for shard in shards for s in iter_raw_samples(shard, names[shard])}


def write_config(path: Path, model_path: Path, raw: Path | str, run_dir: Path, window_uri: str, **sections) -> Path:
    """A run config for the tiny model; `sections` = {"train": {"lr": 1e-3}, ...} merged over the base."""
    base = {
        "run": {"dir": str(run_dir)},
        "model": {"family": "ltx-video", "path": str(model_path)},
        "data": {"raw": str(raw)},
        "buckets": {"sizes": ["9x64x96", "9x64x64", "9x64x128"], "fps": 8.0},
        "window": {"uri": window_uri, "size": 2, "poll_seconds": 0.05, "timeout_seconds": 120.0},
        "precompute": {"samples_per_shard": 2, "encode_batch": 2, "workers": 1},
        "train": {"batch_size": 2, "lr": 1e-3, "epochs": 1},
        "log": {"progress": False},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    from vt.shared.config import Config, build, to_toml

    path.write_text(to_toml(build(Config, base, "")))
    return path


def sectioned(*settings: dict) -> tuple[dict, dict]:
    """(train keys, other sections) of `settings` merged in order: a dict value under a section's name is that
    section ({"mode": "full", "ema": {"decay": 0.5}}), merged key by key; anything else is a train key."""
    from vt.shared.config import Config

    train, sections = {}, {}
    for layer in settings:
        for key, value in layer.items():
            if key in Config.model_fields and isinstance(value, dict):
                sections[key] = {**sections.get(key, {}), **value}
            else:
                train[key] = value
    return train, sections


def start(stage: str, config: Path, *overrides: str, log: Path | None = None, env: dict | None = None) -> Forked:
    """Start `vt-<stage> run CONFIG` as its own process (stdout+stderr to `log`), forked from the warm
    interpreter of tests/helpers/forkserver.py."""
    args = ["run", str(config)]
    for text in overrides:
        args += ["--set", text]
    return launch(f"vt-{stage}", *args, env=env, log=log)


def finish(proc: Forked, log: Path | None = None, timeout: float = 300) -> None:
    code = proc.wait(timeout=timeout)
    if code != 0:
        text = log.read_text()[-4000:] if log and log.exists() else ""
        raise AssertionError(f"{proc.args[0]} exited with {code}:\n{text}")


def run_forked(command: str, *args: str, log: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """(exit code, output) of `command` (vt-train, vt-precompute or a Python file's path) with `args`, forked from
    the warm interpreter of tests/helpers/forkserver.py (no import bill), stdout and stderr together in `log`; killed
    once `timeout` passes, failing the test with its output instead of hanging it."""
    proc = launch(command, *args, env=env, log=log)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        text = log.read_text()[-4000:] if log.exists() else ""
        raise AssertionError(f"{command} {list(args[:2])} did not end within {timeout}s:\n{text}") from None
    return code, log.read_text() if log.exists() else ""


def run_bounded(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output, text) in a session of its own, killed with all its children (decode workers
    hold its pipes) once `timeout` passes: a hung CLI fails the test with its output instead of hanging it."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{args[:3]} did not end within {timeout}s:\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
