"""parallel.activation_offload (train/parallel/offload.py): the checkpointed blocks' inputs go through host memory
between forward and backward; training is unchanged, and the plan counts the device memory it saves."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runs import write_config
from safetensors.torch import load_file

from vt.shared.config import load_config


def test_offloaded_block_inputs_train_as_without(tmp_path, tiny_model_factory, raw_shards):
    from vt.precompute.service import Precompute
    from vt.train.trainer import Trainer

    model = tiny_model_factory("wan")

    def run(name: str, offload: bool):
        config = load_config(write_config(
            tmp_path / f"{name}.toml", model, raw_shards, tmp_path / name, str(tmp_path / "window"),
            model={"family": "wan", "max_text_tokens": 16}, buckets={"sizes": ["9x64x96"]}, window={"size": "keep"},
            precompute={"workers": 0}, train={"max_steps": 3, "lr": 5e-2, "checkpoint_every": 0},
            parallel={"activation_checkpointing": True, "activation_offload": offload}))
        if not (tmp_path / "window").exists():
            Precompute(config).run()
        trainer = Trainer(config)
        trainer.run()
        losses = [m["loss"] for m in map(json.loads, (tmp_path / name / "metrics.jsonl").open()) if "loss" in m]
        return trainer, losses, load_file(tmp_path / name / "lora" / "pytorch_lora_weights.safetensors")

    plain, plain_losses, plain_lora = run("plain", False)
    offloaded, losses, lora = run("offloaded", True)
    assert offloaded.offload.offloaded >= 3 * 2  # at least every block's input of every step went to host memory
    assert losses == pytest.approx(plain_losses, rel=1e-5, abs=0)
    assert all(torch.allclose(lora[k], plain_lora[k], rtol=1e-5, atol=1e-7) for k in plain_lora)


def test_the_plan_counts_the_inputs_left_in_host_memory(tiny_model_factory):
    from vt.shared.config import Config, build
    from vt.train.plan import make_plan

    def plan(**parallel):
        return make_plan(build(Config, {
            "model": {"family": "wan", "path": str(tiny_model_factory("wan")), "max_text_tokens": 16},
            "buckets": {"sizes": ["33x512x512"]}, "parallel": {"activation_checkpointing": True, **parallel}}),
            1, "cuda", stage1=False)

    checkpointed, offloaded = plan(), plan(activation_offload=True)
    bucket = offloaded.activations["33x512x512"]
    assert bucket["offload"] < bucket["checkpointing"] and offloaded.rank.activations == bucket["offload"]
    assert checkpointed.rank.activations == bucket["checkpointing"]
    with pytest.raises(ValueError, match="set parallel.activation_checkpointing = true"):
        build(Config, {"parallel": {"activation_offload": True}})
