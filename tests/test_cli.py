"""The CLIs stop at start-up on bad input with a message that says what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import write_config

BIN = Path(sys.executable).parent
DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("stage", ["vt-precompute", "vt-train"])
def test_unknown_key_exits_2_naming_the_key(stage):
    result = run(stage, "run", str(DEMO), "--set", "train.lrr=1")
    assert result.returncode == 2
    assert "unknown key 'train.lrr'" in result.stderr and "allowed:" in result.stderr


def test_bad_value_names_the_choices():
    result = run("vt-train", "run", str(DEMO), "--set", "train.mode=qlora")
    assert result.returncode == 2 and "choose one of ['lora', 'full']" in result.stderr


def test_missing_config_file():
    result = run("vt-train", "run", "no/such.toml")
    assert result.returncode == 2 and "does not exist" in result.stderr


@pytest.mark.parametrize("stage", ["vt-precompute", "vt-train"])
def test_missing_model_path_says_which_key_to_set(tmp_path, raw_shards, stage):
    config = write_config(tmp_path / "run.toml", tmp_path / "no-model", raw_shards, tmp_path / "run",
                          str(tmp_path / "window"))
    result = run(stage, "run", str(config))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "model.path" in result.stderr and "Traceback" not in result.stderr


def test_help_lists_the_run_command():
    result = run("vt-train", "--help")
    assert result.returncode == 0 and "run" in result.stdout


SHIPPED = sorted(p for p in DEMO.parent.glob("*.toml") if p.name != "demo.toml")


@pytest.mark.parametrize("stage", ["vt-precompute", "vt-train"])
@pytest.mark.parametrize("config", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_a_hub_id_offline_is_one_line_naming_component_id_and_fix(tmp_path, raw_shards, stage, config):
    """A shipped config names a hub id; without network the CLI says so in one line, no traceback.

    The CLI's own app runs in this process (typer's runner: same argument parsing, same error path),
    so the 2 x configs cases do not each pay a Python start-up; the first case of each stage runs the
    installed command as a real process too."""
    from typer.testing import CliRunner

    from vt.precompute.cli import app as precompute_app
    from vt.shared.config import load_config
    from vt.train.cli import app as train_app

    hub_id = load_config(config).model.path
    args = ["run", str(config), "--set", f'run.dir="{tmp_path / "run"}"', "--set", f'window.uri="{tmp_path / "window"}"',
            "--set", f'data.raw="{raw_shards}"', "--set", "log.wandb=false"]
    outcomes = [CliRunner().invoke({"vt-precompute": precompute_app, "vt-train": train_app}[stage], args)]
    if config == SHIPPED[0]:
        outcomes.append(run(stage, *args))
    for outcome in outcomes:
        code = getattr(outcome, "exit_code", getattr(outcome, "returncode", None))
        assert code == 1, outcome.stderr[-2000:]
        assert "Traceback" not in outcome.stderr
        errors = [line for line in outcome.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, outcome.stderr[-2000:]
        assert f"hub id '{hub_id}'" in errors[0] and "HF_HUB_OFFLINE" in errors[0] and "model.path" in errors[0]
