"""The CLIs stop at start-up on bad input with a message that says what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli_runs import run_bounded, run_forked, write_config

BIN = Path(sys.executable).parent
DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def run(*args: str) -> subprocess.CompletedProcess:
    return run_bounded([str(BIN / args[0]), *args[1:]], timeout=120)


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
    config = write_config(
        tmp_path / "run.toml", tmp_path / "no-model", raw_shards, tmp_path / "run", str(tmp_path / "window")
    )
    # Forked from the warm interpreter (stdout and stderr together): the error path, without the import bill.
    code, output = run_forked(stage, "run", str(config), log=tmp_path / "out.log", timeout=120)
    assert code == 1, output[-2000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.path" in errors[0] and "Traceback" not in output, output[-2000:]


def test_help_lists_the_run_command():
    result = run("vt-train", "--help")
    assert result.returncode == 0 and "run" in result.stdout


SHIPPED = sorted(p for p in DEMO.parent.glob("*.toml") if p.name != "demo.toml")


# Runs a CLI's app on each config in turn inside one process (the app itself: same argument parsing,
# same error path, real stderr), forked from the warm interpreter (tests/helpers/forkserver.py), so checking
# every shipped config costs no Python start-up at all.
EACH_CONFIG = """
import sys
from importlib import import_module

app = import_module(sys.argv[1]).app
args = sys.argv[3:]
for config in sys.argv[2].split(","):
    sys.stdout.flush()  # stdout and stderr share one file: each config's output stays between its markers
    print("=== " + config, file=sys.stderr, flush=True)
    code = app(["run", config, *args], standalone_mode=False)
    sys.stdout.flush()
    print("=== exit " + str(code), file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("stage", ["vt-precompute", "vt-train"])
def test_a_hub_id_offline_is_one_line_naming_component_id_and_fix(tmp_path, raw_shards, stage):
    """Every shipped config names hub ids; without network the CLI says so in one line, no traceback."""
    from vt.shared.config import load_config

    module = {"vt-precompute": "vt.precompute.cli", "vt-train": "vt.train.cli"}[stage]
    args = [
        "--set",
        f'run.dir="{tmp_path / "run"}"',
        "--set",
        f'window.uri="{tmp_path / "window"}"',
        "--set",
        f'data.raw="{raw_shards}"',
        "--set",
        "log.wandb=false",
    ]
    script = tmp_path / "each_config.py"
    script.write_text(EACH_CONFIG)
    code, output = run_forked(
        str(script), module, ",".join(map(str, SHIPPED)), *args, log=tmp_path / "out.log", timeout=300
    )
    assert code == 0, output[-2000:]
    runs = output.split("=== ")[1:]
    outputs = dict(zip(runs[0::2], runs[1::2]))  # "<config>\n<its output>" -> "exit <code>\n"
    assert len(outputs) == len(SHIPPED)
    for head, exit_line in outputs.items():
        config, _, output = head.partition("\n")
        hub_id = load_config(config).model.path
        assert exit_line.startswith("exit 1"), f"{config}: {exit_line}{output[-2000:]}"
        assert "Traceback" not in output, f"{config}: {output[-2000:]}"
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, f"{config}: {output[-2000:]}"
        assert f"hub id '{hub_id}'" in errors[0] and "HF_HUB_OFFLINE" in errors[0] and "model.path" in errors[0]


BUG = """
import sys
from vt.train import trainer

def broken(self, config):
    raise ValueError("boom inside vt")

trainer.Trainer.__init__ = broken
from vt.train.cli import app
app(["run", sys.argv[1]])
"""


def test_a_users_error_is_one_line_and_a_bug_keeps_its_traceback(tmp_path, tiny_model_factory, raw_shards):
    """A bucket the family cannot take (the user's config) is one `error:` line; a ValueError raised where vt did
    not expect one (a bug) is not dressed up as the user's error: its traceback is printed."""
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run",
        str(tmp_path / "window"),
        buckets={"sizes": ["10x64x64"]},
    )
    # Both forked from the warm interpreter (stdout and stderr together): the error paths, without the import bill.
    code, output = run_forked("vt-precompute", "run", str(config), log=tmp_path / "user.log", timeout=120)
    assert code == 1 and "Traceback" not in output, output[-2000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "frames must be 8k+1" in errors[0] and "buckets.sizes" in errors[0], output
    script = tmp_path / "bug.py"
    script.write_text(BUG)
    code, output = run_forked(str(script), str(config), log=tmp_path / "bug.log", timeout=120)
    assert code != 0 and "Traceback" in output and "ValueError: boom inside vt" in output, output[-2000:]
    assert not any(line.startswith("error:") for line in output.splitlines())
