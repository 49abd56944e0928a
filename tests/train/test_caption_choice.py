"""Several captions per clip: stage 1 stores each distinct caption of a shard once (the caption table) with each
sample's list of captions; the trainer's reader draws one per epoch by a keyed draw of (seed, epoch, sample key), so
one process, two data-parallel ranks reading their slices and a reader resumed from its cursor train the same caption
of every sample in every epoch, and the choice moves between epochs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load

from vt.precompute.service import Precompute
from vt.shared.caption_table import CHOICES, drawn_caption, unpack
from vt.shared.config import load_config
from vt.shared.shards import read_shard_metadata
from vt.shared.window import open_reader
from vt.train.data import BatchReader

from helpers.cli_runs import write_config
from helpers.dist_runs import finish, kill_and_resume, torchrun

SEED, EPOCHS = 0, 3
PROCESSORS = [{"name": "caption", "variant_fields": ["short", "long"]}]  # two more captions from the .json


@pytest.fixture(scope="module")
def window(tmp_path_factory, tiny_model_factory, media_folder) -> str:
    """A kept window of the four real clips, each with three captions from its .json (the given one, a short one
    that every clip shares, a long one of its own): two shards of two samples."""
    root = tmp_path_factory.mktemp("caption-choice")
    folder = root / "clips"
    folder.mkdir()
    for clip in sorted(media_folder.rglob("*.mp4")):
        shutil.copy(clip, folder / clip.name)
        given = clip.with_suffix(".txt").read_text().strip()
        fields = {"caption": given, "short": "a clip", "long": f"{given}, seen in a long shot"}
        (folder / f"{clip.stem}.json").write_text(json.dumps(fields))
    config = write_config(
        root / "pre.toml",
        tiny_model_factory("ltx-video"),
        folder,
        root / "pre",
        str(root / "window"),
        buckets={"sizes": ["9x64x96"]},
        window={"size": "keep"},
        precompute={"workers": 0, "processors": PROCESSORS},
    )
    assert Precompute(load_config(config)).run().committed == 4
    return str(root / "window")


def raw_ids(uri: str) -> set[str]:
    """Every sample key of the window's shards."""
    return {key for keys, *_ in shards(uri) for key in keys}


def shards(uri: str) -> list[tuple[list[str], dict, dict]]:
    """(keys, meta, stored tensors) of every shard, in the window's order."""
    reader, out, position = open_reader(uri), [], 0
    while (record := reader.record_at(position, True)) is not None:
        data = reader.read_shard(record)
        metadata = read_shard_metadata(data)
        out.append((json.loads(metadata["keys"]), json.loads(metadata["meta"]), load(data), metadata))
        position += 1
    return out


def test_each_caption_is_stored_once_and_every_layout_and_resume_draws_the_same(window):
    expected: dict[tuple[int, str], object] = {}
    for keys, meta, stored, metadata in shards(window):
        captions = meta["captions"]
        distinct = list(dict.fromkeys(c for key in keys for c in captions[key]))
        assert all(len(captions[key]) == 3 for key in keys) and len(distinct) == 2 * len(keys) + 1  # "a clip" once
        table = unpack(stored, json.loads(metadata["text_lengths"]))["prompt_embeds"]
        assert table.shape[0] == len(distinct) and stored[CHOICES].shape == (len(keys), 3)
        for epoch in range(EPOCHS):
            for key in keys:
                drawn = captions[key][drawn_caption(SEED, epoch, key, 3)]
                expected[epoch, key] = table[distinct.index(drawn)]
    keys = {key for _, key in expected}
    assert any(len({drawn_caption(SEED, e, key, 3) for e in range(EPOCHS)}) > 1 for key in keys)  # it moves

    def read(readers, stop_after: int | None = None) -> dict:
        got = {}
        for reader in readers:
            for count, batch in enumerate(reader):
                rows = batch.tensors["prompt_embeds"]
                for row, key in enumerate(batch.keys[batch.first : batch.first + rows.shape[0]]):
                    got[batch.epoch, key] = rows[row]
                if stop_after is not None and count + 1 == stop_after:
                    return got, batch.state
        return got

    def reader(**kw):
        return BatchReader(open_reader(window), 2, passes=EPOCHS, on_read=lambda p: None, seed=SEED, **kw)

    one = read([reader()])
    ranks = read([reader(dp_rank=0, dp_size=2), reader(dp_rank=1, dp_size=2)])
    first, state = read([reader()], stop_after=3)
    resumed = reader()
    resumed.load_state_dict(state)
    after = {**first, **read([resumed])}
    for got in (one, ranks, after):
        assert got.keys() == expected.keys()
        for at, tensor in expected.items():
            assert got[at].equal(tensor.float()), at


def trained_choices(run_dir: Path) -> dict[tuple[int, str], int]:
    """(epoch, key) -> which caption the trainer read, from log.samples: samples.jsonl, and each rank's file when
    distributed (a rank's own rows)."""
    files = sorted((run_dir / "samples").glob("rank*.jsonl")) or [run_dir / "samples.jsonl"]
    out: dict[tuple[int, str], int] = {}
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            for key, choice in record.get("captions", {}).items():
                assert out.setdefault((record["epoch"], key), choice) == choice  # a re-logged step agrees
    return out


def test_the_trainer_draws_the_same_captions_in_one_process_killed_and_resumed_and_under_fsdp2(
    tmp_path, window, tiny_model_factory
):
    def config(name: str) -> Path:
        return write_config(
            tmp_path / f"{name}.toml",
            tiny_model_factory("ltx-video"),
            tmp_path,
            tmp_path / name,
            window,
            buckets={"sizes": ["9x64x96"]},
            window={"size": "keep"},
            precompute={"processors": PROCESSORS},
            train={"epochs": EPOCHS, "batch_size": 2, "checkpoint_every": 2, "seed": SEED},
            caption_dropout={"rate": 0.5},  # on top of the choice: drawn per (seed, step, sample)
            log={"samples": True, "progress": False},
        )

    ranks = torchrun(config("fsdp"), 2, "parallel.dp_shard=-1", log=tmp_path / "fsdp.log")
    # One process, killed right after step 2's checkpoint and resumed: its choices before and after the kill.
    kill_and_resume(config("one"), "train.after_checkpoint@1", tmp_path)
    finish(ranks, tmp_path / "fsdp.log")

    expected = {(e, key): drawn_caption(SEED, e, key, 3) for e in range(EPOCHS) for key in raw_ids(window)}
    killed = [json.loads(line)["step"] for line in (tmp_path / "one" / "samples.jsonl").read_text().splitlines()]
    assert killed.count(3) == 1 and max(killed) == 2 * EPOCHS  # steps 1-2 before the kill, 3 on after the resume
    for name in ("one", "fsdp"):
        assert trained_choices(tmp_path / name) == expected, name
