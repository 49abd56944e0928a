"""Provenance: what a shard was made with, and the trainer refusing shards made otherwise.

The stale-cache test precomputes a window with the tiny LTX model, then starts the real trainer
with a changed bucket table, and with a copy of the model whose VAE has one weight changed: both
refuse the old shards with a message naming the setting that differs. A trainer reads no byte of an
encoder it does not load: it trains and validates with the text encoder's files gone (the hub offline),
and checks an encoder it does not load by the names and sizes of its files, or by where it came from.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vt.precompute.service import Precompute
from vt.shared import provenance as prov
from vt.shared.config import load_config
from vt.train.data import StaleShardError
from vt.train.trainer import Trainer

from helpers.cli_runs import write_config

BUCKETS = ["9x64x96", "9x64x64", "9x64x128"]
PROMPTS = ["a rabbit in a meadow"]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_big_files_digest_is_kept_by_size_and_mtime_and_made_again_when_they_change(tmp_path, monkeypatch):
    monkeypatch.setenv("VT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(prov, "CACHE_MIN_BYTES", 1024)
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(64 * 1024, dtype=torch.float32)}, str(path))
    first = prov.cached_file_digest(path)
    assert first == prov.file_digest(path) and prov.digest_cache_path().is_file()
    stat = path.stat()
    flip(path, 5000)  # same size; the modification time put back: taken as unchanged (the documented trade-off)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert prov.cached_file_digest(path) == first != prov.file_digest(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: hashed again
    assert prov.cached_file_digest(path) == prov.file_digest(path) != first
    prov.digest_cache_path().write_text("{torn")  # a broken cache is ignored, then rewritten
    assert prov.cached_file_digest(path) == prov.file_digest(path)


def test_file_digest_samples_big_files(tmp_path, monkeypatch):
    """Small files: every byte counts. Big ones: size, header and sampled blocks (the documented trade-off)."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(64 * 1024, dtype=torch.float32)}, str(path))  # 256 KiB of data
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    small = prov.file_digest(path)
    flip(path, header + 100_000)
    assert prov.file_digest(path) != small  # hashed whole: any byte
    flip(path, header + 100_000)
    assert prov.file_digest(path) == small

    monkeypatch.setattr(prov, "FULL_HASH_BYTES", 64 * 1024)
    monkeypatch.setattr(prov, "HEAD_BYTES", 1024)
    monkeypatch.setattr(prov, "SAMPLE_COUNT", 4)
    monkeypatch.setattr(prov, "SAMPLE_BYTES", 1024)
    sampled = prov.file_digest(path)
    head = max(1024, header)  # the head covers the whole safetensors header; blocks are spread after it
    stride = (path.stat().st_size - head) // 4
    flip(path, head + stride + 10)  # inside the second sampled block
    assert prov.file_digest(path) != sampled
    flip(path, head + stride + 10)
    flip(path, head + stride + 5000)  # between sampled blocks: not seen, by design
    assert prov.file_digest(path) == sampled
    flip(path, head + stride + 5000)
    save_file({"b": torch.arange(64 * 1024, dtype=torch.float32)}, str(path))  # same bytes, other tensor name
    assert prov.file_digest(path) != sampled


def test_provenance_covers_the_encoders_and_the_processing(tmp_path, tiny_model_factory, raw_shards):
    model = tiny_model_factory("ltx-video")
    config = load_config(write_config(tmp_path / "a.toml", model, raw_shards, tmp_path / "run", str(tmp_path / "w")))
    p = prov.provenance(config)
    assert set(p["weights"]) == {"tokenizer", "text_encoder", "vae"}
    assert p["processing"]["buckets"] == sorted(BUCKETS) and p["processing"]["fps"] == 8.0
    assert [step["name"] for step in p["processing"]["processors"]] == ["sample_frames", "crop", "decode"]
    assert p["family"] == "ltx-video" and p["storage_dtype"] == "bfloat16"
    assert prov.fingerprint(prov.provenance(config)) == prov.fingerprint(p)  # both stages agree

    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    vae_file = broken / "vae" / "diffusion_pytorch_model.safetensors"
    vae_file.write_bytes(b"\0" * vae_file.stat().st_size)  # unloadable: the digest must not load weights
    other = load_config(write_config(tmp_path / "b.toml", broken, raw_shards, tmp_path / "run", str(tmp_path / "w")))
    q = prov.provenance(other)
    assert q["weights"]["vae"] != p["weights"]["vae"] and q["weights"]["text_encoder"] == p["weights"]["text_encoder"]
    assert prov.describe_difference(p, q).startswith("weights.vae: shard has ")
    assert prov.describe_difference(p, p).startswith("fingerprints differ but")


@pytest.fixture(scope="module")
def stale_setup(tmp_path_factory, tiny_model_factory, raw_shards):
    """A kept window precomputed with the tiny model from one raw tar."""
    root = tmp_path_factory.mktemp("stale")
    model = tiny_model_factory("ltx-video")
    raw = sorted(raw_shards.glob("*.tar"))[0]
    config = write_config(
        root / "pre.toml",
        model,
        raw,
        root / "pre",
        str(root / "window"),
        window={"size": "keep"},
        precompute={"workers": 0},
        validation={"prompts": PROMPTS},
    )
    Precompute(load_config(config)).run()
    return root, model, raw


def refusal(root: Path, model: Path, raw: Path, name: str, **sections) -> str:
    config = write_config(
        root / f"{name}.toml", model, raw, root / name, str(root / "window"), window={"size": "keep"}, **sections
    )
    with pytest.raises(StaleShardError) as caught:
        Trainer(load_config(config)).run()
    return str(caught.value)


def test_trainer_refuses_shards_of_another_bucket_table(stale_setup):
    root, model, raw = stale_setup
    message = refusal(root, model, raw, "buckets", buckets={"sizes": BUCKETS + ["17x64x64"]})
    assert "processing.buckets: shard has ['9x64x128', '9x64x64', '9x64x96']" in message
    assert "weights" not in message and "Re-run vt-precompute into a fresh window" in message


def test_trainer_refuses_shards_of_another_processor_chain(stale_setup):
    """The window was made with the default chain; a random crop is another chain, named to the option."""
    root, model, raw = stale_setup
    message = refusal(root, model, raw, "chain", precompute={"processors": [{"name": "crop", "mode": "random"}]})
    assert "processing.processors[1:crop].mode: shard has 'center', config wants 'random'" in message
    assert message.count("shard has") == 1 and "weights" not in message


def test_trainer_refuses_shards_of_another_vae(stale_setup, tmp_path):
    """Validation decodes with the VAE, so the trainer loads it and checks it by digest: one weight changed."""
    root, model, raw = stale_setup
    changed = tmp_path / "model"
    shutil.copytree(model, changed)
    vae_file = changed / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(vae_file))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.001  # one weight of the VAE
    save_file(tensors, str(vae_file), metadata={"format": "pt"})
    message = refusal(root, changed, raw, "vae", validation={"prompts": PROMPTS})
    assert message.count("weights.") == 1 and "weights.vae: shard has '" in message


def test_trainer_trains_and_validates_with_the_text_encoder_absent(stale_setup, tmp_path):
    """Only what the trainer loads is on disk (transformer, VAE, scheduler), the hub offline: it never
    reads the text encoder or tokenizer, so it neither hashes nor downloads them."""
    root, model, raw = stale_setup
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    trimmed = tmp_path / "model"
    shutil.copytree(
        model, trimmed, ignore=lambda folder, names: [n for n in names if n in ("text_encoder", "tokenizer")]
    )
    config = write_config(
        root / "trimmed.toml",
        trimmed,
        raw,
        tmp_path / "run",
        str(root / "window"),
        window={"size": "keep"},
        validation={"prompts": PROMPTS},
        train={"max_steps": 2},
    )
    trainer = Trainer(load_config(config))
    summary = trainer.run()
    assert summary["steps"] == 2 and math.isfinite(summary["last_loss"]) and summary["videos"] == 1
    assert sorted(p.name for p in (tmp_path / "run" / "validation").glob("step-*/*.mp4")) == ["00.mp4"]
    # the fingerprint stage 1 computed from every encoder's files, taken from the window
    assert trainer.fingerprint == prov.fingerprint(prov.provenance(load_config(root / "pre.toml")))

    # the checkpoint keeps the shards taken; a resume checks them against its own (here changed) config
    changed = write_config(
        root / "trimmed-resume.toml",
        trimmed,
        raw,
        tmp_path / "run",
        str(root / "window"),
        window={"size": "keep"},
        buckets={"sizes": BUCKETS + ["17x64x64"]},
        train={"max_steps": 3},
    )
    with pytest.raises(StaleShardError, match="the checkpoint's shards .*processing.buckets: shard has"):
        Trainer(load_config(changed)).run()


def test_trainer_checks_an_encoder_it_does_not_load_by_the_sizes_of_its_files(stale_setup, tmp_path):
    root, model, raw = stale_setup
    other = tmp_path / "model"
    shutil.copytree(model, other)
    weights = other / "text_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0" * 8)  # another text encoder on this disk: another size
    message = refusal(root, other, raw, "te-size")
    assert message.count("weights.") == 1 and "weights.text_encoder: " in message and "model.safetensors" in message
