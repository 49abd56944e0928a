"""The trainer's real start-up and step at real size, on a GPU stand-in that counts bytes
(tests/helpers/gpu_standin.py), against `vt-train plan`: start-up device peak, steady device peak and host peak
within 5%.

The trainer runs unchanged (train.device is the stand-in) on fake tensors: Wan 2.1 14B's real config, no weights at
all (the checkpoint is a table of names and shapes), at its usual 81x480x832 bucket; a family with sound (Kandinsky 6
Lite, video and audio streams) likewise (the NF4 and sound rows with fewer blocks of real size: `cases` says which
rows run at real depth and why the others hold the plan as they would there). The traces run in a process of their own
(tests/helpers/gpu_trace_worker.py: the stand-in device is process-wide), started once for the module, while this
process plans the same configs with the plan's own code (a meta-device build and a fake-tensor trace of the family's
forward, on the CPU): the two agree only if the plan models what the trainer really allocates where. Before block swap was built in host memory, the swap
row's start-up device peak here was the whole bf16 model, 27.4 GiB (the plan: 7.4).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import HELPERS
from helpers import gpu_standin as standin
from helpers.polling import wait_for

pytestmark = pytest.mark.filterwarnings("ignore")
SWAP = {"block_swap": {"blocks_on_gpu": 10}}
OFFLOAD = {"activation_offload": {"enabled": True}}
WORKER = HELPERS / "gpu_trace_worker.py"


def tree(folder: Path, work: Path, family: str, bucket: str, sections: dict, **model) -> dict:
    return {
        "model": {"family": family, "path": str(folder), "dtype": "bfloat16", **model},
        "buckets": {"sizes": [bucket]},
        "window": {"uri": str(work / "window")},
        "run": {"dir": str(work / "run")},
        "train": {
            "device": f"{standin.NAME}:0",
            "mixed_precision": "bf16",
            "batch_size": 1,
        },
        "adapter": {"rank": 32, "alpha": 32.0},
        "parallel": {"dp_shard": 1, "activation_checkpointing": True},
        **sections,
        "log": {"progress": False},
    }


def shallow(model: Path, folder: Path, depth: dict) -> Path:
    """A copy of config-only `model` whose transformer has fewer blocks (`depth`: its config's keys for them); every
    other key, so each block's size, the embeddings, the head and the bucket's tokens, as the real one has them."""
    import shutil

    shutil.copytree(model, folder)
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **depth}, indent=1))
    return folder


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name -> (config tree, GGUF block type); the worker traces them in this order (the tests'), each test waiting
    for its own.

    The swap and Q4_K rows run Wan 2.1 14B at its real depth (40 blocks): the swap row's absolute claims (start-up
    < 8 GiB, 30 blocks' weights in host memory) are about that model; at 4 blocks the Q4_K row's step plan came out
    0.78 GiB over its trace (15.06 against 14.28 GiB, 5.5%; not yet explained), within 5% at real depth. The NF4 and
    sound rows compare the plan with the trace on the same config, so they run the real models' blocks (widths,
    heads, FFN, text tokens, bucket: real size) but fewer of them (Wan: 4 of 40; Kandinsky 6 Lite: 4 of 32 visual
    blocks, 2 on the GPU): each block adds the same to both sides (its weights, its checkpointed input, its swap
    arena), and what the plan gets wrong outside the blocks weighs more at this depth, not less. The NF4 row's
    headline (it fits 24 GiB at real depth, docs/memory.md) is the plan's at real depth, which the rows here hold to
    the trace: test_what_fits_24_gib_is_searched_in_pairs_cheapest_first."""
    from memory_table import config_only_model

    root = tmp_path_factory.mktemp("gpu-trace")
    wan, k6 = config_only_model("wan2.1-14b", root / "wan"), config_only_model("kandinsky6-lite", root / "k6")
    wan4 = shallow(wan, root / "wan-4", {"num_layers": 4})
    k6_4 = shallow(k6, root / "k6-4", {"num_visual_blocks": 4})
    return {
        "swap+offload": (
            tree(wan, root / "a", "wan", "81x480x832", {**SWAP, **OFFLOAD}, max_text_tokens=512),
            None,
        ),
        "nf4+offload": (
            tree(
                wan4,
                root / "b",
                "wan",
                "81x480x832",
                {**OFFLOAD, "frozen_base": {"quantize": "nf4"}},
                max_text_tokens=512,
            ),
            None,
        ),
        "q4_k": (tree(wan, root / "c", "wan", "81x480x832", {}, max_text_tokens=512), 12),
        "sound": (
            tree(
                k6_4,
                root / "d",
                "kandinsky6",
                "121x480x864",
                {"block_swap": {"blocks_on_gpu": 2}, **OFFLOAD},
                max_text_tokens=1024,
                audio=True,
            ),
            None,
        ),
        "root": root,
    }


@pytest.fixture(scope="module")
def traces(cases):
    """traces(name) -> the worker's trace of case `name` (waits for it; the worker runs beside this process)."""
    root = cases["root"]
    spec = {name: {"config": case[0], "gguf": case[1]} for name, case in cases.items() if name != "root"}
    (root / "cases.json").write_text(json.dumps(spec))
    out, log = root / "traces.json", (root / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), str(root / "cases.json"), str(out)], stdout=log, stderr=subprocess.STDOUT
    )

    def read(name: str):
        def done():
            if worker.poll() not in (None, 0):
                raise AssertionError(
                    f"the trace worker exited {worker.returncode}:\n" + (root / "worker.log").read_text()[-3000:]
                )
            try:
                return json.loads(out.read_text()).get(name)
            except (OSError, ValueError):
                return None

        return wait_for(done, timeout=900, interval=0.5, what=f"the trace of {name}")

    yield read
    worker.kill()
    worker.wait(timeout=30)
    log.close()


def process_state() -> dict:
    """What of this process's global torch state a fake-tensor trace depends on (as a fresh `vt-train plan` has it)."""
    import gc

    return {
        "gc enabled": gc.isenabled(),
        "grad enabled": torch.is_grad_enabled(),
        "anomaly mode": torch.is_anomaly_enabled(),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
        "saved-tensor hooks allowed": torch._C._autograd._saved_tensors_hooks_is_enabled(),
        "cpu autocast": torch.is_autocast_enabled("cpu"),
        "default dtype": str(torch.get_default_dtype()),
    }


FRESH = {
    "gc enabled": True,
    "grad enabled": True,
    "anomaly mode": False,
    "dispatch modes": 0,
    "function modes": 0,
    "saved-tensor hooks": False,
    "saved-tensor hooks allowed": True,
    "cpu autocast": False,
    "default dtype": "torch.float32",
}


@pytest.fixture(scope="module", autouse=True)
def fresh_process_state():
    """This module's plans from a process state like a fresh `vt-train plan`'s, and plan caches of their own. In one
    full run (2026-12-05) the same pytest worker ran other tests first and all five plans below came out as if
    without activation checkpointing (step device 495 GiB against the trace's 22); the caches' keys differ per
    module, and it has not failed again in the full runs since. Should it, the leaked global state is named
    here, before any plan."""
    from vt.train import plan

    assert process_state() == FRESH, "a test before this module left global torch state changed"
    for cache in (plan._TRACES, plan._PREPARED, plan._VAE_PEAKS):
        cache.clear()


def plan_of(config_tree: dict, gguf: int | None):
    from vt.shared.config import Config, build
    from vt.shared.models import spec_for
    from vt.train.plan import make_plan

    config = build(Config, config_tree)
    spec = spec_for(config)
    meta = spec.empty_component("transformer")
    weights = standin.FakeWeights(meta, torch.bfloat16, standin.linear_packings(meta, gguf) if gguf else None)
    with standin.standin_components(weights, "transformer.gguf" if gguf else None):  # (the table of a GGUF file)
        return config, make_plan(config, 1, "cuda", stage1=False, lean=True)


def assert_plan_matches(plan, traced, tolerance: float = 0.05) -> dict:
    rank = plan.rank
    host = max(traced["startup"].get("cpu", 0), traced["step"].get("cpu", 0))
    rows = {
        "start-up device": (rank.startup, traced["startup"][standin.NAME]),
        "step device": (rank.device_total, traced["step"][standin.NAME]),
        "host": (rank.host_peak, host),
    }
    report = ", ".join(
        f"{what}: plan {standin.gib(p):.2f} GiB, trace {standin.gib(t):.2f} GiB" for what, (p, t) in rows.items()
    )
    assert all(standin.close(p, t, tolerance) for p, t in rows.values()), f"{report}; process: {process_state()}"
    return rows


def test_block_swap_with_activation_offload_starts_with_the_resident_blocks_only(cases, traces):
    _, plan = plan_of(*cases["swap+offload"])
    traced = traces("swap+offload")
    rows = assert_plan_matches(plan, traced)
    # Built where it lives: 30 of 40 blocks' frozen weights (19.6 GiB) never reach the device ...
    assert standin.gib(rows["start-up device"][1]) < 8 and standin.gib(rows["host"][1]) > 19
    # ... and their host arenas are page-locked at exactly their bytes (no power-of-two pinned blocks: 30 blocks of
    # 0.66 GiB would take 30 GiB), what the plan counts
    assert traced["pinned"] == plan.rank.swapped and standin.gib(plan.rank.swapped) < 20


def test_nf4_base_with_activation_offload(cases, traces):
    _, plan = plan_of(*cases["nf4+offload"])
    assert_plan_matches(plan, traces("nf4+offload"))
    # (that it fits a 24 GB card at real depth, as docs/memory.md says: test_what_fits_24_gib_..., the plan's own)


def test_gguf_q4_k_base(cases, traces):
    _, plan = plan_of(*cases["q4_k"])
    assert_plan_matches(plan, traces("q4_k"))


def test_a_family_with_sound_swapped_and_offloaded(cases, traces):
    _, plan = plan_of(*cases["sound"])
    assert_plan_matches(plan, traces("sound"))


def test_the_nf4_table_goes_to_the_device_once(traces):
    """Each NF4 matmul dequantizes through a 256-entry table: copied to the device once per process, not once per
    dequantize from pageable host memory (a host sync each, ~1,200 a Wan 14B step)."""
    from vt.shared.weights.quantize import NF4_PAIRS

    assert traces("nf4_table_copies") == [list(NF4_PAIRS.shape)]


def test_what_fits_24_gib_is_searched_in_pairs_cheapest_first(cases):
    """`vt-train plan --gpu-memory 24` for Wan 2.1 14B's LoRA: no single change fits one 24 GiB card, pairs do (a
    quantized base or block swap with activation offload); each listed once, minimal, quickest first, none that the
    trainer would refuse. (After the plans above in this process: it reuses their traces.)"""
    from vt.train.plan_search import alternatives
    from vt.train.step_cost import step_seconds

    config, plan = plan_of(
        tree(
            Path(cases["swap+offload"][0]["model"]["path"]),
            cases["root"] / "e",
            "wan",
            "81x480x832",
            {},
            max_text_tokens=512,
        ),
        None,
    )
    budget = 24 * 2**30
    assert plan.rank.device_total > budget  # as it is, it does not fit
    fitting = alternatives(config, 1, "cuda", budget, host_budget=64 * 2**30)
    labels = [label for label, _ in fitting]
    assert "frozen_base.quantize=nf4 + activation_offload.enabled=true" in labels  # (40 blocks: fits 24 GiB, below)
    assert any("block_swap.blocks_on_gpu=" in label and "activation_offload" in label for label in labels)
    assert all(p.rank.device_total <= budget and p.rank.host_peak <= 64 * 2**30 for _, p in fitting)
    single = [label for label in labels if " + " not in label]
    assert not any(one in label.split(" + ") for one in single for label in labels if label != one)
    times = [step_seconds(p) for _, p in fitting]
    assert times == sorted(times)
