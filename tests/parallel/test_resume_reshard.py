"""Kill a 4-rank FSDP2 run right after a checkpoint, resume it with 2 ranks and the same global batch:
the losses continue exactly as in the uninterrupted run (full fine-tuning and LoRA). A LoRA
checkpoint holds the adapters and their optimizer state, never the frozen base weights."""

from __future__ import annotations


from dist_runs import assert_same_training, finish, losses, torchrun


def kill_at_4_then_resume_at_2(tmp_path, run_config, family: str):
    config = run_config(tmp_path, family, "run")
    killed = torchrun(config, 4, log=tmp_path / "killed.log",
                      env={"VT_FAULT_AT": "train.after_checkpoint@1"})  # every rank dies after the step-2 save
    assert killed.wait(timeout=300) != 0
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
    assert sorted(losses(run_dir)) == [1, 2]
    assert not (run_dir / "lora").exists() and not (run_dir / "model").exists()

    finish(torchrun(config, 2, log=tmp_path / "resumed.log"), tmp_path / "resumed.log")
    log = (tmp_path / "resumed.log").read_text()
    assert "resumed from" in log and "at step 2" in log and "world 2 = " in log
    return run_dir


def test_full_fine_tune_resumes_at_another_world_size(tmp_path, run_config, reference):
    run_dir = kill_at_4_then_resume_at_2(tmp_path, run_config, "ltx-video")
    assert_same_training(run_dir, reference("ltx-video"))  # steps 1-2 from 4 ranks, 3-4 from 2


def test_lora_resumes_at_another_world_size_from_an_adapter_only_checkpoint(tmp_path, run_config, reference,
                                                                            kept_window):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    run_dir = kill_at_4_then_resume_at_2(tmp_path, run_config, "wan")
    assert_same_training(run_dir, reference("wan"))

    checkpoint = run_dir / "checkpoints" / "step-000004"
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    model_keys = [k for k in metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), \
        [k for k in model_keys if "lora_" not in k][:3]

    def nbytes(meta) -> int:
        return meta.size.numel() * meta.properties.dtype.itemsize

    adapters = sum(nbytes(metadata[k]) for k in model_keys)
    tensors = sum(nbytes(m) for m in metadata.values() if isinstance(m, TensorStorageMetadata))
    steps = sum(1 for k in metadata if k.endswith(".step"))
    assert tensors == 3 * adapters + steps * 4  # weights, Adam's two moments, a float32 step each

    _, model = kept_window("wan")
    base = sum(v.numel() * v.element_size() for v in load_file(next((model / "transformer").glob("*.safetensors"))).values())
    on_disk = sum(f.stat().st_size for f in checkpoint.iterdir())
    # With the frozen base inside, the files would hold at least its bytes on top of the adapters' state.
    assert on_disk < tensors + base, f"{on_disk} bytes on disk: the frozen base ({base} bytes) seems to be in it"
    assert adapters < base / 2
