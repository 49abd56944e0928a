"""Stage 1's text phase once per several shards (`precompute.text_phase_shards`): with `text_encoder_offload =
"model"` the captions of the next full shards are encoded together, so an offloaded text encoder (MiniMax H3's 62 GiB
Qwen3-VL) crosses to the GPU once for all of them, from one host arena per encoder; the window holds exactly what a
run with the encoder on the device writes, and a crash between a group's commits loses nothing and repeats nothing.

This machine has no GPU: `encoders.MOVE_ON_CPU` makes a CPU run's text phases move the encoders as onto a GPU (the
same arena, a real copy of every weight each phase), and `text_moves` counts the phases that moved them."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import pytest
import torch
from torch import nn

from vt.precompute import encoders as stage1_encoders
from vt.shared.config import load_config
from vt.shared.storage import Storage
from vt.shared.window import Writer, open_reader

from helpers.cli_runs import raw_keys, write_config

GROUP = 3  # precompute.text_phase_shards in these runs


@pytest.fixture(scope="module")
def raw_distinct(raw_shards, tmp_path_factory) -> Path:
    """Two of the real raw tars (8 samples cut from the real clips), each sample's caption made its own (the clips'
    pieces share their clip's caption), so every shard of one sample brings a caption not encoded yet."""
    folder = tmp_path_factory.mktemp("raw-distinct")
    for tar_path in sorted(raw_shards.glob("*.tar"))[:2]:
        with (
            tarfile.open(tar_path) as src,
            tarfile.open(folder / tar_path.name, "w", format=tarfile.USTAR_FORMAT) as out,
        ):
            for info in src.getmembers():
                data = src.extractfile(info).read()
                if info.name.endswith(".txt"):
                    data = f"{data.decode()}, piece {info.name.removesuffix('.txt')}".encode()
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
    return folder


def run(tmp_path: Path, model: Path, raw: Path, name: str, offload: str, window=None, family="wan", task="t2v"):
    """A producer run writing one sample a shard, `GROUP` shards a text phase; (producer, report, shard files)."""
    from vt.precompute.service import Precompute

    uri = str(tmp_path / f"{name}-window")
    config = load_config(
        write_config(
            tmp_path / f"{name}.toml",
            model,
            raw,
            tmp_path / name,
            uri,
            model={"family": family, "task": task, "max_text_tokens": 16},
            buckets={"sizes": ["5x64x64"]},  # the VAE's share kept small: this is about the text phase
            window={"size": "keep"},
            validation={"prompts": ["a fox in the snow"]},
            precompute={
                "samples_per_shard": 1,
                "workers": 0,
                "text_encoder_offload": offload,
                "text_phase_shards": GROUP,
            },
        )
    )
    producer = Precompute(config)
    if window is not None:
        producer.window = window(uri)
    report = producer.run()
    return producer, report, window_files(Path(uri))


def window_files(window: Path) -> dict[str, bytes]:
    """The window's safetensors files (shards, empty caption, validation conditions) by where they sit: a shard by its
    lane, seq and generation (its name's last part is an attempt's own)."""
    return {
        str(
            path.parent.relative_to(window) / (path.stem.rsplit("-", 1)[0] if "data" in path.parts else path.name)
        ): path.read_bytes()
        for path in window.rglob("*.safetensors")
    }


def content(data: bytes) -> str:
    """A shard file's metadata and tensors (the caption conditions among them), whatever order its header lists them
    in (safetensors writes its header's keys in no fixed order)."""
    from safetensors.torch import load

    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    tensors = load(data)
    return json.dumps(
        {
            "meta": header["__metadata__"],
            "tensors": {name: tensors[name].flatten().tolist() for name in sorted(tensors)},
        },
        sort_keys=True,
    )


# Wan: captions alone (the text cache); HunyuanVideo i2v: its Llava also reads each caption with the clip's first frame,
# per sample (`spec.text_with_image`), in the same phase.
@pytest.mark.parametrize("family, task", [("wan", "t2v"), ("hunyuan-video", "i2v")])
def test_an_offloaded_text_encoder_crosses_once_per_group_of_shards_and_the_window_is_unchanged(
    tmp_path, tiny_model_factory, raw_distinct, monkeypatch, family, task
):
    model = tiny_model_factory(family, task)
    _, on_device, expected = run(tmp_path, model, raw_distinct, "on-device", "none", family=family, task=task)
    monkeypatch.setattr(stage1_encoders, "MOVE_ON_CPU", True)
    producer, offloaded, files = run(tmp_path, model, raw_distinct, "offloaded", "model", family=family, task=task)
    shards = offloaded.shards
    assert shards == on_device.shards == len(raw_keys(raw_distinct)) == 8
    # one phase at start (the empty caption and the validation prompt together), then one per GROUP shards, each of
    # which brings new captions: 1 + 3 here, where a phase per shard (and one more at start) made 1 + 1 + 8
    assert stage1_encoders.text_moves(producer.encoders, producer.spec) == 1 + math.ceil(shards / GROUP)
    # every shard byte for byte as the encoder on the device wrote it: same seq, keys, latents and text conditions
    assert files.keys() == expected.keys() and len([name for name in files if name.startswith("data/")]) == shards
    assert {name: content(data) for name, data in files.items()} == {
        name: content(data) for name, data in expected.items()
    }


class CrashAfterRecord(Exception):
    """Stands in for the producer dying right after a commit."""


def test_a_crash_between_the_commits_of_one_text_phase_commits_every_sample_once(
    tmp_path, tiny_model_factory, raw_distinct
):
    class CrashingWindow(Writer):
        """A real window whose producer dies right after the record of its second shard: the first text phase's
        third shard is encoded but not committed."""

        def publish(self, record, data):
            out = super().publish(record, data)
            if record.seq == 1:
                raise CrashAfterRecord(f"after the record of shard {record.seq}")
            return out

    model = tiny_model_factory("wan")
    with pytest.raises(CrashAfterRecord):
        run(
            tmp_path,
            model,
            raw_distinct,
            "crashed",
            "model",
            window=lambda uri: CrashingWindow(Storage(uri), "keep", 0.2, 1800.0),
        )
    _, report, _ = run(tmp_path, model, raw_distinct, "crashed", "model")
    assert report.resumed_at == 2 and report.shards == 6
    window = open_reader(str(tmp_path / "crashed-window"))
    committed = [key for seq in range(window.next_seq(0)) for key in window.record(0, seq).keys]
    assert sorted(committed) == sorted(raw_keys(raw_distinct))  # each sample once: none lost, none twice


def test_a_phase_encodes_its_captions_a_shards_worth_at_a_time(tiny_model_factory):
    """The text cache fills a group's new captions in calls of at most `batch` (the encoder's working memory as with one
    shard), each caption once, and a full cache keeps the captions asked for."""
    from vt.precompute.text_cache import TextCache

    spec, encoders = tiny_wan(tiny_model_factory)
    calls: list[list[str]] = []

    def encode(captions):
        calls.append(captions)
        return spec.encode_text(encoders, captions)

    cache = TextCache(encode, max_entries=6, batch=2)
    cache.fill(["a", "b", "a", "c", "d", "e"])
    assert calls == [["a", "b"], ["c", "d"], ["e"]] and cache.new(["a", "e", "f"]) == ["f"]
    cache.fill(["e", "f", "g"])  # 5 + 2 > 6: emptied but for e
    assert calls[3:] == [["f", "g"]] and sorted(cache.entries) == ["e", "f", "g"]
    alone = spec.encode_text(encoders, ["c"])
    assert all(torch.equal(cache.encode(["c"])[k], alone[k]) for k in alone)  # as encoded alone


def tiny_wan(tiny_model_factory):
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    spec = build_spec(ModelConfig(family="wan", path=str(tiny_model_factory("wan")), max_text_tokens=16), 8.0)
    return spec, stage1_encoders.load_encoders(spec, torch.device("cpu"), "none", vae_tiling=False)


def test_a_text_encoder_waits_in_one_host_arena_and_its_phases_copy_in_only(tiny_model_factory):
    from vt.shared.host_memory import pinned_bytes

    spec, encoders = tiny_wan(tiny_model_factory)
    expected = spec.encode_text(encoders, ["a fox in the snow"])
    module = encoders["text_encoder"]
    pinned = pinned_bytes()
    copy = stage1_encoders.HostCopy(module, torch.device("cpu"))
    arena = copy.arena.bytes.untyped_storage().data_ptr()
    held = list(module.parameters()) + list(module.buffers())
    assert {t.untyped_storage().data_ptr() for t in held} == {arena}  # every weight and buffer a view of one arena
    assert pinned_bytes() == pinned and not copy.arena.pinned  # a CPU device: nothing page-locked
    copy.to_device()
    copy.to_device()  # a nested phase: already there
    on_device = [t.untyped_storage().data_ptr() for t in module.parameters()]
    assert arena not in on_device and copy.moves == 1  # a copy of every weight, made once
    result = spec.encode_text(encoders, ["a fox in the snow"])
    copy.to_host()
    assert all(t.untyped_storage().data_ptr() != arena for t in module.parameters())  # the inner phase ended only
    copy.to_host()
    assert all(torch.equal(result[k], expected[k]) for k in expected)
    assert {t.untyped_storage().data_ptr() for t in module.parameters()} == {arena}  # back on its views, no copy


def test_a_weight_held_twice_is_one_view_and_one_copy():
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    second.weight = first.weight  # tied, as an embedding and its output projection can be
    module = nn.Sequential(first, second)
    expected = module(torch.ones(2, 8))
    copy = stage1_encoders.HostCopy(module, torch.device("cpu"))
    assert len(copy.host) == 3 and second.weight is first.weight  # weight, two biases
    assert copy.arena.size == 512 * 3  # each view aligned to 512 bytes: the tied weight once
    copy.to_device()
    assert second.weight is first.weight and torch.equal(module(torch.ones(2, 8)), expected)
    copy.to_host()
    assert first.weight.untyped_storage().data_ptr() == copy.arena.bytes.untyped_storage().data_ptr()
