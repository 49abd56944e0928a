"""One GPU's memory settings: activation_offload.enabled (train/parallel/offload.py), the checkpointed blocks'
inputs through host memory between forward and backward, and block_swap.blocks_on_gpu (parallel/block_swap.py),
blocks' frozen weights in host memory copied in a block ahead; training is unchanged, the plan counts both."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from vt.shared.config import load_config

from helpers.cli_runs import write_config


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_factory, raw_shards):
    """run(name, **parallel) -> (trainer, losses, exported LoRA) of 3 steps of the tiny Wan with activation
    checkpointing, on one window precomputed once."""
    from vt.precompute.service import Precompute
    from vt.train.trainer import Trainer

    root = tmp_path_factory.mktemp("one-gpu")
    model = tiny_model_factory("wan")
    runs = {}

    def train(name: str, **sections):
        if name in runs:
            return runs[name]
        config = load_config(
            write_config(
                root / f"{name}.toml",
                model,
                raw_shards,
                root / name,
                str(root / "window"),
                model={"family": "wan", "max_text_tokens": 16},
                buckets={"sizes": ["9x64x96"]},
                window={"size": "keep"},
                precompute={"workers": 0},
                train={"max_steps": 3, "lr": 5e-2, "checkpoint_every": 0},
                parallel={"activation_checkpointing": True},
                **sections,
            )
        )
        if not (root / "window").exists():
            Precompute(config).run()
        trainer = Trainer(config)
        trainer.run()
        losses = [m["loss"] for m in map(json.loads, (root / name / "metrics.jsonl").open()) if "loss" in m]
        runs[name] = trainer, losses, load_file(root / name / "lora" / "pytorch_lora_weights.safetensors")
        return runs[name]

    return train


def assert_same(got, expected):
    (_, losses, lora), (_, expected_losses, expected_lora) = got, expected
    assert len(losses) == 3 and losses == pytest.approx(expected_losses, rel=1e-5, abs=0)
    assert all(torch.allclose(lora[k], expected_lora[k], rtol=1e-5, atol=1e-7) for k in expected_lora)


def test_offloaded_block_inputs_train_as_without(run):
    offloaded = run("offloaded", activation_offload={"enabled": True})
    offload = offloaded[0].parts["activation_offload"].offload
    assert offload.offloaded >= 3 * 2  # at least every block's input of every step went to host memory
    # each input came back ahead of its use (the one saved before it, while it was in use), and the host arena is
    # one buffer of the most a step saved, taken again by every step after the first
    assert offload.fetched_ahead >= 3 * 1 and not offload.arena.extra
    assert offload.arena.grow_to == offload.arena.peak > 0 or offload.arena.buffer.size == offload.arena.peak
    assert_same(offloaded, run("plain"))


def test_swapped_blocks_train_as_resident_ones_and_go_back_to_host_memory(run):
    swapped = run("swapped", block_swap={"blocks_on_gpu": 0})  # both blocks of the tiny Wan swapped
    swap = swapped[0].parts["block_swap"].swap
    assert swap.swapped == {0, 1}
    # Per step: each block copied in for its forward and again for its recomputation in backward, but the last
    # block, whose forward copies stay for its recomputation (backward's first).
    assert swap.loads == 3 * (2 * 2 - 1)
    for index in swap.swapped:  # after the run every swapped block computes from nothing but its host copy
        params = {name: p for name, p in swap.blocks[index].named_parameters() if not p.requires_grad}
        assert params and all(p.data_ptr() == swap.host[index][name].data_ptr() for name, p in params.items())
    assert_same(swapped, run("plain"))


def test_the_plan_counts_the_inputs_left_in_host_memory(tiny_model_factory):
    from vt.shared.config import Config, build
    from vt.train.plan import make_plan

    def plan(checkpointing=True, **sections):
        return make_plan(
            build(
                Config,
                {
                    "model": {"family": "wan", "path": str(tiny_model_factory("wan")), "max_text_tokens": 16},
                    "buckets": {"sizes": ["33x512x512"]},
                    "parallel": {"activation_checkpointing": checkpointing},
                    **sections,
                },
            ),
            1,
            "cuda",
            stage1=False,
        )

    checkpointed, offloaded = plan(), plan(activation_offload={"enabled": True})
    bucket = offloaded.activations["33x512x512"]
    # What stays on the device, plus one input on its way back ahead of its use; the rest in the host arena.
    assert bucket["offload"] - bucket["offload_largest"] < bucket["checkpointing"]
    assert offloaded.rank.activations == bucket["offload"] and offloaded.rank.offloaded == bucket["offload_host"] > 0
    assert checkpointed.rank.activations == bucket["checkpointing"]
    with pytest.raises(ValueError, match="set parallel.activation_checkpointing = true"):
        plan(checkpointing=False, activation_offload={"enabled": True})


def test_the_plan_keeps_swapped_blocks_in_host_memory(tiny_model_factory):
    from vt.shared.config import Config, build
    from vt.train.plan import make_plan

    def plan(checkpointing=True, **sections):
        return make_plan(
            build(
                Config,
                {
                    "model": {"family": "wan", "path": str(tiny_model_factory("wan")), "max_text_tokens": 16},
                    "buckets": {"sizes": ["9x64x96"]},
                    "parallel": {"activation_checkpointing": checkpointing},
                    **sections,
                },
            ),
            1,
            "cuda",
            stage1=False,
        )

    resident, swapped = plan(), plan(block_swap={"blocks_on_gpu": 0})
    # Two blocks, both swapped: built in host memory (start-up holds neither), both in flight while the step runs,
    # so this small depth saves nothing at the peak; a real depth moves all but two blocks' frozen weights (the
    # 14B's 40 blocks: tests/train/test_gpu_trace.py).
    frozen = resident.rank.weights - swapped.rank.weights
    assert frozen > 0 and swapped.rank.startup == resident.rank.startup - frozen
    assert swapped.rank.in_flight == frozen and swapped.rank.device_total == resident.rank.device_total
    assert frozen <= swapped.rank.swapped < frozen + 2 * 512 * 64  # the host arenas: their bytes, each view aligned
    with pytest.raises(ValueError, match="set parallel.activation_checkpointing = true"):
        plan(checkpointing=False, block_swap={"blocks_on_gpu": 2})
