"""Kill a 4-rank FSDP2 run right after a checkpoint, resume it with 2 ranks and the same global batch:
the losses continue exactly as in the uninterrupted run (full fine-tuning and LoRA). A LoRA
checkpoint holds the adapters and their optimizer state, never the frozen base weights. The default
layout (dp_shard = "auto") resumes with the choice its first start kept in the run folder."""

from __future__ import annotations

from helpers.dist_runs import assert_same_training, finish, losses, torchrun


def kill_then_resume(
    tmp_path,
    run_config,
    family: str,
    ranks: tuple[int, int] = (4, 2),
    overrides: tuple[str, ...] = ("parallel.dp_shard=-1",),
):
    """Kill a run of ranks[0] processes after its step-2 checkpoint, resume it with ranks[1]; FSDP2 unless
    `overrides` say otherwise."""
    config = run_config(tmp_path, family, "run")
    killed = torchrun(
        config, ranks[0], *overrides, log=tmp_path / "killed.log", env={"VT_FAULT_AT": "train.after_checkpoint@1"}
    )  # every rank dies after the step-2 save
    assert killed.wait(timeout=300) != 0
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
    assert sorted(losses(run_dir)) == [1, 2]
    assert not (run_dir / "lora").exists() and not (run_dir / "model").exists()

    finish(torchrun(config, ranks[1], *overrides, log=tmp_path / "resumed.log"), tmp_path / "resumed.log")
    log = (tmp_path / "resumed.log").read_text()
    assert "resumed from" in log and "at step 2" in log and f"world {ranks[1]} = " in log
    return run_dir


def kill_at_4_then_resume_at_2(tmp_path, run_config, family: str):
    return kill_then_resume(tmp_path, run_config, family)


def test_the_default_layout_resumes_with_the_choice_kept_in_the_run_folder(tmp_path, run_config, reference):
    """dp_shard = "auto" (the default): the first start plans and picks DDP for a tiny LoRA, the resume at the
    same world size reads that choice from run.dir/layout.json instead of planning again, and trains on."""
    run_dir = kill_then_resume(tmp_path, run_config, "wan", ranks=(2, 2), overrides=())
    killed, resumed = (tmp_path / "killed.log").read_text(), (tmp_path / "resumed.log").read_text()
    line = "parallel.dp_shard = auto: replicate (DDP); planned peak per rank"
    assert line in killed and "kept in" not in killed
    assert f"(kept in {run_dir / 'layout.json'})" in resumed and resumed.count(line) == 1
    assert "world 2 = dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 (DDP)" in resumed
    assert_same_training(run_dir, reference("wan"))


def test_full_fine_tune_resumes_at_another_world_size(tmp_path, run_config, reference):
    run_dir = kill_at_4_then_resume_at_2(tmp_path, run_config, "ltx-video")
    assert_same_training(run_dir, reference("ltx-video"))  # steps 1-2 from 4 ranks, 3-4 from 2


def test_lora_resumes_at_another_world_size_from_an_adapter_only_checkpoint(
    tmp_path, run_config, reference, kept_window
):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    run_dir = kill_at_4_then_resume_at_2(tmp_path, run_config, "wan")
    assert_same_training(run_dir, reference("wan"))

    checkpoint = run_dir / "checkpoints" / "step-000004"
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    model_keys = [k for k in metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), [
        k for k in model_keys if "lora_" not in k
    ][:3]

    def nbytes(meta) -> int:
        return meta.size.numel() * meta.properties.dtype.itemsize

    adapters = sum(nbytes(metadata[k]) for k in model_keys)
    tensors = sum(nbytes(m) for m in metadata.values() if isinstance(m, TensorStorageMetadata))
    steps = sum(1 for k in metadata if k.endswith(".step"))
    assert tensors == 3 * adapters + steps * 4  # weights, Adam's two moments, a float32 step each

    _, model = kept_window("wan")
    base = sum(
        v.numel() * v.element_size() for v in load_file(next((model / "transformer").glob("*.safetensors"))).values()
    )
    on_disk = sum(f.stat().st_size for f in checkpoint.iterdir())
    # With the frozen base inside, the files would hold at least its bytes on top of the adapters' state.
    assert on_disk < tensors + base, f"{on_disk} bytes on disk: the frozen base ({base} bytes) seems to be in it"
    assert adapters < base / 2
