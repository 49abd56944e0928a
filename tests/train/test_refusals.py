"""What the trainer cannot run is refused at start-up with the reason and what to use, and `vt-train plan` refuses
the same configs with the same words (train/refusals.py), instead of tracing them or offering them as a fit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vt.shared.config import Config, build, to_toml
from vt.shared.errors import UserError

BIN = Path(sys.executable).parent


def config(model: Path, **sections) -> Config:
    tree = {
        "model": {"family": "wan", "path": str(model), "max_text_tokens": 16},
        "buckets": {"sizes": ["9x64x96"]},
        "parallel": {"activation_checkpointing": True},
    }
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    return build(Config, tree)


REFUSED = {
    "block swap with compile": (
        {"block_swap": {"blocks_on_gpu": 1}, "parallel": {"compile": True}},
        "set parallel.compile = false",
    ),
    "block swap with CPU offload": (
        {"block_swap": {"blocks_on_gpu": 1}, "parallel": {"cpu_offload": True}},
        "CPU offload keeps every weight in host memory already",
    ),
    "block swap of a full fine-tune": (
        {"block_swap": {"blocks_on_gpu": 1}, "train": {"mode": "full"}},
        "use parallel.cpu_offload = true for a full fine-tune",
    ),
    "LoKr with tensor parallel": (
        {"parallel": {"tp": 2, "dp_shard": 1}, "adapter": {"kind": "lokr"}},
        "tensor parallel splits only LoRA's two factors",
    ),
    "DoRA on a quantized base": (
        {"adapter": {"kind": "dora"}, "frozen_base": {"quantize": "nf4"}},
        'set adapter.kind = "lora"',
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_plan_refuses_what_the_trainer_refuses(tiny_model_factory, case):
    from vt.shared.models import spec_for
    from vt.train import refusals
    from vt.train.plan import make_plan

    sections, words = REFUSED[case]
    run = config(tiny_model_factory("wan"), **sections)
    gpus = 2 if run.parallel.tp > 1 else 1
    with pytest.raises(UserError, match=words) as trainer_says:
        refusals.check(run, spec_for(run), gpus)  # what Trainer.__init__ calls before it builds anything
    with pytest.raises(UserError) as plan_says:
        make_plan(run, gpus, "cuda", stage1=False)
    assert str(plan_says.value) == str(trainer_says.value)


def test_the_trainer_stops_before_building_and_the_plan_command_says_why(tiny_model_factory, tmp_path):
    from vt.train.trainer import Trainer

    sections, words = REFUSED["block swap with compile"]
    run = config(tiny_model_factory("wan"), run={"dir": str(tmp_path / "run")}, **sections)
    with pytest.raises(UserError, match=words):
        Trainer(run)
    path = tmp_path / "lokr.toml"
    path.write_text(to_toml(config(tiny_model_factory("wan"), **REFUSED["LoKr with tensor parallel"][0])))
    out = subprocess.run(
        [str(BIN / "vt-train"), "plan", str(path), "--gpus", "2", "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "tensor parallel splits only LoRA's two factors" in out.stderr + out.stdout
