"""DoRA, LoHa and LoKr (adapter.kind) train through the real trainer and export a file of their kind: one process
each on Wan's tiny preset (the parity runs' kept window, 4 steps), and DoRA also under FSDP2 (2 ranks over gloo),
equal to one process within 1e-4 (losses, gradient norms, exported weights): its magnitudes start from each rank's
own rows of the filled base weight. Every kind's first loss is the base model's. Tensor parallel is refused for a
non-LoRA kind."""

from __future__ import annotations

import json

import pytest
import torch

from vt.shared import adapters

from helpers.dist_runs import assert_same_training, finish, single, torchrun

FAMILY = "wan"


def exported(run_dir) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(the diffusers file's tensors, its adapter metadata, the names of the run's lora/ files)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = run_dir / "lora" / "pytorch_lora_weights.safetensors"
    with safe_open(str(path), "pt") as handle:
        metadata = json.loads(handle.metadata()["lora_adapter_metadata"])
    return load_file(path), metadata, sorted(p.name for p in (run_dir / "lora").iterdir())


# On the worker of the Wan parity rows: their kept window (precomputed once) is this test's.
@pytest.mark.xdist_group("parity-wan")
def test_each_adapter_kind_trains_and_exports_its_kind_and_dora_shards_like_one_process(tmp_path, run_config):
    from vt.train.trackers import read_metrics

    runs = {}
    for kind in ("dora", "loha", "lokr"):
        log = tmp_path / f"{kind}.log"
        finish(single(run_config(tmp_path, FAMILY, kind, adapter={"kind": kind}), log=log), log)
        runs[kind] = tmp_path / kind
    for kind, run_dir in runs.items():
        tensors, metadata, files = exported(run_dir)
        assert adapters.kind_of(tensors) == kind and all(adapters.is_adapter(k) for k in tensors)
        assert metadata["transformer.r"] == 16  # adapter.rank's default, as the adapters were built
        assert metadata.get("transformer.use_dora") is (True if kind == "dora" else None)
        assert metadata.get("transformer.peft_type") == {"loha": "LOHA", "lokr": "LOKR"}.get(kind)
        # ComfyUI's file for LoHa and LoKr; DoRA's diffusers file only (ComfyUI's DoRA normalises other axes)
        assert ("lora_comfyui.safetensors" in files) == (kind != "dora"), files
        zero = [k for k in tensors if adapters.part_of(k) in adapters.ZERO_FACTORS]
        assert zero and all(tensors[k].abs().max() > 0 for k in zero), f"{kind}: the zero factor did not train"
        losses = [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]
        assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert "dora saved for diffusers only" in (tmp_path / "dora.log").read_text()
    # Every kind starts as the base model (the delta's zero factor zero; DoRA's magnitudes the rows' norms, filled
    # after the base): the first step's loss, taken before any update, is the same for all.
    first = {
        kind: {m["step"]: m for m in read_metrics(run_dir / "metrics.jsonl")}[1]["loss"]
        for kind, run_dir in runs.items()
    }
    assert first["dora"] == pytest.approx(first["loha"], rel=1e-5) and first["lokr"] == pytest.approx(
        first["loha"], rel=1e-5
    ), first

    # DoRA's magnitudes start at the base rows' norms on each shard: FSDP2 trains what one process trains.
    config = run_config(tmp_path, FAMILY, "fsdp", adapter={"kind": "dora"})
    finish(torchrun(config, 2, "parallel.dp_shard=-1", log=tmp_path / "fsdp.log"), tmp_path / "fsdp.log")
    assert_same_training(tmp_path / "fsdp", runs["dora"])

    # Tensor parallel splits only LoRA's factors: another kind is refused with the setting named.
    config = run_config(tmp_path, FAMILY, "tp", adapter={"kind": "loha"}, max_steps=1)
    proc = torchrun(config, 2, "parallel.dp_shard=1", "parallel.tp=2", log=tmp_path / "tp.log")
    assert proc.wait(timeout=300) != 0
    assert "adapter.kind = 'loha' with parallel.tp = 2" in (tmp_path / "tp.log").read_text()
