"""The trainer's real start-up and step at real size, on a GPU stand-in that counts bytes (tests/gpu_standin.py),
against `vt-train plan`: start-up device peak, steady device peak and host peak within 5%.

The trainer runs unchanged (train.device is the stand-in) on fake tensors: Wan 2.1 14B's real config, random-free
(no weights at all: the checkpoint is a table of names and shapes), at its usual 81x480x832 bucket; a family with
sound (Kandinsky 6 Lite, video and audio streams) likewise. The plan is computed from the same config files by its own
code (a meta-device build and a fake-tensor trace of the family's forward), not from this run: the two agree only if
the plan models what the trainer really allocates where. Before block swap was built in host memory, the start-up
device peak of the swap rows here was the whole bf16 model (27.1 GiB for 14B), the plan's 7.4.
"""

from __future__ import annotations

import pytest
import torch

import gpu_standin as standin

pytestmark = pytest.mark.filterwarnings("ignore")
SWAP = {"blocks_on_gpu": 10}
OFFLOAD = {"activation_offload": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Config-only folders of the real models (scripts/memory_table.py: real component configs, no weights)."""
    from memory_table import config_only_model

    standin.install()  # before the first backward of this process: autograd sizes its device queues then
    root = tmp_path_factory.mktemp("real-configs")
    return lambda key: config_only_model(key, root / key)


def run_config(models, tmp_path, key: str, family: str, bucket: str, parallel: dict, train: dict, **model):
    from vt.shared.config import Config, build

    return build(Config, {
        "model": {"family": family, "path": str(models(key)), "dtype": "bfloat16", **model},
        "buckets": {"sizes": [bucket]}, "window": {"uri": str(tmp_path / "window")}, "run": {"dir": str(tmp_path / "run")},
        "train": {"device": f"{standin.NAME}:0", "mixed_precision": "bf16", "batch_size": 1, "lora_rank": 32,
                  "lora_alpha": 32.0, **train},
        "parallel": {"dp_shard": 1, "activation_checkpointing": True, **parallel}, "log": {"progress": False}})


def plan_and_trace(config, gguf_type: int | None = None):
    """(the plan of `config` on one CUDA GPU, the trace of the trainer's start-up and steady step)."""
    from vt.shared.buckets import parse_buckets
    from vt.shared.models import spec_for
    from vt.train.plan import make_plan

    spec = spec_for(config)
    meta = spec.empty_component("transformer")
    packings = standin.linear_packings(meta, gguf_type) if gguf_type else None
    weights = standin.FakeWeights(meta, torch.bfloat16, packings)
    shapes = spec.condition_shapes(parse_buckets(config.buckets.sizes)[0])
    with standin.standin_components(weights, "transformer.gguf" if gguf_type else None):
        plan = make_plan(config, 1, "cuda", stage1=False, lean=True)
        sample = {name: (torch.ones if "mask" in name else torch.zeros)(shape) for name, shape in shapes.items()}
        traced = standin.trace_trainer(config, sample)
    return plan, traced


def assert_plan_matches(plan, traced, tolerance: float = 0.05):
    rank = plan.rank
    host = max(traced["startup"].get("cpu", 0), traced["step"].get("cpu", 0))
    rows = {"start-up device": (rank.startup, traced["startup"][standin.NAME]),
            "step device": (rank.device_total, traced["step"][standin.NAME]),
            "host": (rank.host_peak, host)}
    report = ", ".join(f"{what}: plan {standin.gib(p):.2f} GiB, trace {standin.gib(t):.2f} GiB"
                       for what, (p, t) in rows.items())
    assert all(standin.close(p, t, tolerance) for p, t in rows.values()), report
    return rows


def test_block_swap_with_activation_offload_starts_with_the_resident_blocks_only(models, tmp_path):
    config = run_config(models, tmp_path, "wan2.1-14b", "wan", "81x480x832", {**SWAP, **OFFLOAD}, {},
                        max_text_tokens=512)
    plan, traced = plan_and_trace(config)
    rows = assert_plan_matches(plan, traced)
    # Built where it lives: 30 of 40 blocks' frozen weights (19.6 GiB) never reach the device ...
    assert standin.gib(rows["start-up device"][1]) < 8 and standin.gib(rows["host"][1]) > 19
    # ... and their host arenas are page-locked at exactly their bytes (no power-of-two pinned blocks: 30 blocks of
    # 0.66 GiB would take 30 GiB), what the plan counts
    assert traced["pinned"] == plan.rank.swapped and standin.gib(plan.rank.swapped) < 20


def test_nf4_base_with_activation_offload(models, tmp_path):
    config = run_config(models, tmp_path, "wan2.1-14b", "wan", "81x480x832", OFFLOAD, {"quantize_base": "nf4"},
                        max_text_tokens=512)
    plan, traced = plan_and_trace(config)
    assert_plan_matches(plan, traced)
    assert standin.gib(plan.rank.device_total) < 24  # what docs/memory.md says fits a 24 GB card without block swap


def test_gguf_q4_k_base(models, tmp_path):
    config = run_config(models, tmp_path, "wan2.1-14b", "wan", "81x480x832", {}, {}, max_text_tokens=512)
    plan, traced = plan_and_trace(config, gguf_type=12)
    assert_plan_matches(plan, traced)


def test_a_family_with_sound_swapped_and_offloaded(models, tmp_path):
    config = run_config(models, tmp_path, "kandinsky6-lite", "kandinsky6", "121x480x864", {"blocks_on_gpu": 8, **OFFLOAD},
                        {}, max_text_tokens=1024, audio=True)
    plan, traced = plan_and_trace(config)
    assert_plan_matches(plan, traced)


def test_the_nf4_table_goes_to_the_device_once(models):
    """Each NF4 matmul dequantizes through a 256-entry table: copied to the device once per process, not once per
    dequantize from pageable host memory (a host sync each, ~1,200 a Wan 14B step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vt.shared.weights import quantize

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copies = []

    class CountCopies(standin.DeviceBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and \
                    (kwargs or {}).get("device") == standin.DEVICE:
                copies.append(tuple(args[0].shape))
            return super().__torch_dispatch__(func, types, args, kwargs)

    try:
        with fake, CountCopies(fake):
            codes = torch.empty(64, 32, dtype=torch.uint8, device=standin.DEVICE)
            absmax = torch.empty(64, 1, device=standin.DEVICE)
            for _ in range(3):
                quantize.dequantize_nf4(codes, absmax, torch.bfloat16)
    finally:
        quantize._PAIRS_ON.pop(standin.DEVICE, None)
    assert copies == [tuple(quantize.NF4_PAIRS.shape)]


def test_what_fits_24_gib_is_searched_in_pairs_cheapest_first(models, tmp_path):
    """`vt-train plan --gpu-memory 24` for Wan 2.1 14B's LoRA: no single change fits one 24 GiB card, pairs do (a
    quantized base or block swap with activation offload); each listed once, minimal, quickest first, none that the
    trainer would refuse. (Runs after the traces above in this process: it reuses their plan traces.)"""
    from vt.train.plan import make_plan
    from vt.train.plan_search import alternatives

    config = run_config(models, tmp_path, "wan2.1-14b", "wan", "81x480x832", {}, {}, max_text_tokens=512)
    budget = 24 * 2**30
    fitting = alternatives(config, 1, "cuda", budget, host_budget=64 * 2**30)
    labels = [label for label, _ in fitting]
    assert "train.quantize_base=nf4 + parallel.activation_offload=true" in labels
    assert any("parallel.blocks_on_gpu=" in label and "activation_offload" in label for label in labels)
    assert all(plan.rank.device_total <= budget and plan.rank.host_peak <= 64 * 2**30 for _, plan in fitting)
    single = [label for label in labels if " + " not in label and "GPUs" not in label]
    assert not any(label.startswith(f"{one} + ") or label.endswith(f" + {one}") for one in single for label in labels)
    from vt.train.step_cost import step_seconds

    times = [step_seconds(plan) for _, plan in fitting]
    assert times == sorted(times)
    assert make_plan(config, 1, "cuda", stage1=False, lean=True).rank.device_total > budget  # as is: it does not fit
