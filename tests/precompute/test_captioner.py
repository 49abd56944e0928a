"""Captions from a vision-language model (`caption_model`): a tiny real Llava (random weights, a locally built tokenizer
and processor; precompute/captioner_preset.py) captions real clips in stage 1, greedy, on the producer, in a phase of
its own. The same clip gets the same caption in one process and with two producers on one window; the window's
provenance names the captioner and a trainer configured with another captioner refuses it; `vt-precompute caption`
writes reviewable sidecars, and an edited sidecar changes that sample's stored text and nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vt.precompute.captioner_preset import make_tiny_captioner
from vt.precompute.service import Precompute
from vt.shared.config import load_config
from vt.shared.shards import decode_shard
from vt.shared.window import open_reader
from vt.train.data import StaleShardError
from vt.train.trainer import Trainer

from helpers.cli_runs import finish, start, write_config

NEW_TOKENS = 6
TEXT_NAMES = ("prompt_embeds", "prompt_attention_mask")  # the tiny LTX-Video's text conditions


@pytest.fixture(scope="module")
def captioners(tmp_path_factory) -> dict[str, Path]:
    """The tiny captioner, and one of other weights (another seed)."""
    root = tmp_path_factory.mktemp("captioners")
    return {"tiny": make_tiny_captioner(root / "tiny", seed=0), "other": make_tiny_captioner(root / "other", seed=1)}


@pytest.fixture(scope="module")
def clip_folder(media_folder, tmp_path_factory) -> Path:
    """The media folder's four real clips (1.5 s pieces) with their .txt captions, no stills."""
    out = tmp_path_factory.mktemp("clip-folder")
    for clip in sorted(media_folder.rglob("*.mp4")):
        for path in (clip, clip.with_suffix(".txt")):
            shutil.copy(path, out / path.name)
    return out


def caption_chain(model: Path, mode: str = "replace") -> list[dict]:
    return [
        {"name": "decode"},
        {"name": "caption_model", "model": str(model), "mode": mode, "max_new_tokens": NEW_TOKENS, "frames": 2},
    ]


def config_for(tmp_path: Path, name: str, model: Path, raw: Path, processors: list[dict], **precompute) -> Path:
    return write_config(
        tmp_path / f"{name}.toml",
        model,
        raw,
        tmp_path / name,
        str(tmp_path / name / "window"),
        buckets={"sizes": ["9x64x96"]},
        window={"size": "keep"},
        precompute={"workers": 0, "processors": processors, **precompute},
    )


def stored(uri: str) -> dict[str, dict]:
    """key -> {"captions": its captions as stage 1 recorded them, "tensors": {name: its row}} of every shard."""
    reader = open_reader(uri)
    out = {}
    position = 0
    while (record := reader.record_at(position, True)) is not None:
        position += 1
        tensors, keys, meta = decode_shard(reader.read_shard(record))
        for row, key in enumerate(keys):
            out[key] = {
                "captions": meta.get("captions", {}).get(key),
                "tensors": {name: t[row] for name, t in tensors.items()},
                "provenance": meta["provenance"],
                "sources": meta["sources"],
            }
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_factory, captioners, clip_folder):
    """A kept window captioned by the tiny captioner, one producer in this process."""
    root = tmp_path_factory.mktemp("one-process")
    model = tiny_model_factory("ltx-video")
    config = config_for(root, "one", model, clip_folder, caption_chain(captioners["tiny"]))
    report = Precompute(load_config(config)).run()
    return root, model, report, stored(str(root / "one" / "window"))


def test_the_same_clip_gets_the_same_caption_in_one_process_and_with_two_producers(
    tmp_path, one_process, captioners, clip_folder
):
    _, model, report, alone = one_process
    assert report.committed == 4 and report.seconds["caption"] > 0
    given = {path.stem: path.read_text().strip() for path in clip_folder.glob("*.txt")}
    captions = {key: value["captions"] for key, value in alone.items()}
    assert all(len(c) == 1 and c[0] for c in captions.values())
    assert not {c[0] for c in captions.values()} & set(given.values())  # replaced by the model's
    assert len({c[0] for c in captions.values()}) > 1  # the frames steer the text: not one caption for all

    config = config_for(tmp_path, "two", model, clip_folder, caption_chain(captioners["tiny"]), lanes=2)
    logs = [tmp_path / f"producer{i}.log" for i in range(2)]
    procs = [start("precompute", config, log=log) for log in logs]
    for proc, log in zip(procs, logs):
        finish(proc, log, timeout=300)
    both = stored(str(tmp_path / "two" / "window"))
    assert {key: value["captions"] for key, value in both.items()} == captions
    for key, value in both.items():  # the same text conditions, stored from the same captions
        for name, tensor in value["tensors"].items():
            if name not in ("latents",):
                assert tensor.equal(alone[key]["tensors"][name]), (key, name)


def test_provenance_names_the_captioner_and_a_trainer_with_another_refuses_the_window(one_process, captioners):
    root, model, _, alone = one_process
    first = next(iter(alone.values()))
    step = next(s for s in first["provenance"]["processing"]["processors"] if s["name"] == "caption_model")
    assert step["model"] == str(captioners["tiny"]) and step["max_new_tokens"] == NEW_TOKENS
    assert first["sources"]["captioner"]["source"] == str(captioners["tiny"])
    assert len(first["provenance"]["weights"]["captioner"]) == 16

    config = config_for(root, "other", model, Path(root / "unused"), caption_chain(captioners["other"]))
    config = load_config(config, [f"window.uri={root / 'one' / 'window'}", "train.max_steps=1"])
    with pytest.raises(StaleShardError) as caught:
        Trainer(config).run()
    message = str(caught.value)
    assert "caption_model].model: shard has" in message and str(captioners["other"]) in message


def test_caption_writes_sidecars_and_an_edited_one_changes_that_samples_text_alone(
    tmp_path, one_process, captioners, clip_folder
):
    from vt.precompute.caption_review import write_caption_sidecars

    _, model, _, alone = one_process
    folder = tmp_path / "clips"
    shutil.copytree(clip_folder, folder)
    # dedup before the captioner (copies are not captioned in a run): a review has no window to keep its table in, so
    # it captions every clip; max_distance 0 keeps the demo's two carphones apart in the run below
    decode, captioner = caption_chain(captioners["tiny"])
    chain = [decode, {"name": "dedup", "max_distance": 0}, captioner]
    config = load_config(config_for(tmp_path, "review", model, folder, chain))
    done = write_caption_sidecars(config)
    assert len(done.written) == 4 and not done.rejected and not list(tmp_path.glob("review/window*"))
    sidecars = {Path(url).stem: json.loads(Path(url).read_text()) for url in done.written}
    by_key = {key.rsplit("/", 1)[-1]: value for key, value in alone.items()}
    for stem, fields in sidecars.items():  # what a run would train on: the run's own captions
        assert [fields["caption"]] == by_key[stem]["captions"] and fields["captioner"]

    edited = sorted(sidecars)[0]
    (folder / f"{edited}.json").write_text(json.dumps({**sidecars[edited], "caption": "a rabbit in a meadow"}))
    Precompute(config).run()
    reviewed = {key.rsplit("/", 1)[-1]: value for key, value in stored(str(tmp_path / "review" / "window")).items()}
    assert reviewed.keys() == by_key.keys()
    for stem, value in reviewed.items():
        before = by_key[stem]
        assert value["captions"] == (["a rabbit in a meadow"] if stem == edited else before["captions"])
        for name, tensor in value["tensors"].items():
            if stem != edited or name not in TEXT_NAMES:
                assert tensor.equal(before["tensors"][name]), (stem, name)
        if stem == edited:
            assert not value["tensors"]["prompt_embeds"].equal(before["tensors"]["prompt_embeds"])


def test_the_captioner_holds_device_memory_only_inside_its_phase(captioners, monkeypatch):
    """On a GPU the captioner lives in host memory (one arena, encoders.HostCopy) and is copied onto the device for each
    captioning phase, the copy dropped when the phase ends, before the VAE encodes. MOVE_ON_CPU stands in for the device
    on a CPU: the same arena and copies, so outside a phase every weight is the arena's view, inside it a copy."""
    import torch

    from vt.precompute import encoders
    from vt.precompute.captioner import Captioner
    from vt.shared.chain import CaptionModelOptions

    monkeypatch.setattr(encoders, "MOVE_ON_CPU", True)
    captioner = Captioner(CaptionModelOptions(model=str(captioners["tiny"])), torch.device("cpu"), torch.float32)

    def weights() -> set[int]:
        return {parameter.data_ptr() for parameter in captioner.model.parameters()}

    for phase in (1, 2):
        with captioner.phase():
            inside = weights()
        arena = {view.data_ptr() for view in captioner.host.host}
        assert captioner.host.moves == phase and not inside & arena  # a copy for the phase, one per phase
        assert weights() <= arena  # after it, the arena's views: the phase's copy is dropped
