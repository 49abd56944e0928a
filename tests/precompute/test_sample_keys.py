"""A sample is its raw shard plus its key: keys numbered per shard, repeated keys and repeated members.

Hand-made webdataset sets number keys per tar (every tar holds 000000, 000001, ...), so the key
alone does not name a sample. Stage 1 keys samples as `<raw shard name>/<key>`, the shard name
taken below the common folder of all raw shards, and a key repeated inside one tar is rejected as
`duplicate_key` (the first sample with it is kept), as is a repeated member (`a.mp4` twice, as
`tar --append` leaves it). The real `vt-precompute run` process must end with exit 0, commit every
sample once under its own key, and list each duplicate in rejects.jsonl, once even across a restart.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from vt.precompute.service import Precompute
from vt.precompute.sources import iter_raw_samples, shard_names
from vt.shared.config import load_config
from vt.shared.storage import Storage
from vt.shared.window import Writer, open_reader
from vt.train.data import BatchReader

from helpers.cli_runs import finish, raw_keys, start, write_config


def test_shard_names_are_relative_to_the_common_folder_of_all_shards():
    assert shard_names(["/d/raw/a/000.tar", "/d/raw/b/000.tar.gz", "/d/raw/b/c/001.TGZ"]) == {
        "/d/raw/a/000.tar": "a/000",
        "/d/raw/b/000.tar.gz": "b/000",
        "/d/raw/b/c/001.TGZ": "b/c/001",
    }
    assert shard_names(["s3://bucket/raw/x-000.tar", "s3://bucket/raw/x-001.tar"]) == {
        "s3://bucket/raw/x-000.tar": "x-000",
        "s3://bucket/raw/x-001.tar": "x-001",
    }
    assert shard_names(["raw/only.tar"]) == {"raw/only.tar": "only"}
    # Two tars that differ only in their suffix keep it: names stay unique.
    assert shard_names(["r/x.tar", "r/x.tgz", "r/y.tar"]) == {"r/x.tar": "x.tar", "r/x.tgz": "x.tgz", "r/y.tar": "y"}


def test_a_key_repeated_inside_a_shard_is_a_duplicate(media, good_clip, tmp_path):
    caption = b"a gray fade"
    shard = media.write_tar(
        tmp_path / "s.tar",
        [
            ("000000.mp4", good_clip),
            ("000000.txt", caption),
            ("000001.mp4", good_clip),
            ("000001.txt", caption),
            ("000000.mp4", good_clip),
            ("000000.txt", b"the same key again"),  # samples in between
            ("a.mp4", good_clip),
            ("a.mp4", good_clip),
            ("a.txt", caption),  # a member twice in a row
        ],
    )
    samples = list(iter_raw_samples(str(shard)))
    assert [(s.sample_id, s.position, s.error) for s in samples] == [
        ("s/000000", 0, None),
        ("s/000001", 1, None),
        ("s/000000", 2, "duplicate_key"),
        ("s/a", 3, "missing_caption"),
        ("s/a", 4, "duplicate_key"),
    ]  # the first `a` is the one kept
    assert "came earlier" in samples[2].detail and samples[2].caption is None


def _per_shard_numbered(folder: Path, media) -> None:
    """raw/cam-a/000.tar and raw/cam-b/000.tar both hold 000000 and 000001 (same file names too);
    raw/mixed.tar repeats a key with a sample between, and a member twice in a row."""
    clip = media.encode_clip(media.gray_frames(12))
    caption = b"a gray fade"
    for camera in ("cam-a", "cam-b"):
        (folder / camera).mkdir(parents=True)
        media.write_tar(
            folder / camera / "000.tar",
            [(f"{key}.{ext}", data) for key in ("000000", "000001") for ext, data in (("mp4", clip), ("txt", caption))],
        )
    media.write_tar(
        folder / "mixed.tar",
        [
            ("000000.mp4", clip),
            ("000000.txt", caption),
            ("000001.mp4", clip),
            ("000001.txt", caption),
            ("000000.mp4", clip),
            ("000000.txt", caption),  # duplicate_key
            ("000002.mp4", clip),
            ("000002.txt", caption),
            ("000002.txt", caption),  # duplicate_key (a lone .txt)
        ],
    )


def test_keys_numbered_per_shard_through_the_cli(tmp_path, media, tiny_model_factory):
    raw = tmp_path / "raw"
    _per_shard_numbered(raw, media)
    uri = str(tmp_path / "window")
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw,
        run_dir,
        uri,
        window={"size": "keep"},
        precompute={"workers": 1, "samples_per_shard": 4},
    )
    log = tmp_path / "precompute.log"  # 4 a shard: both tars' 000000 and 000001 meet in the first one
    finish(start("precompute", config, log=log), log)  # exit 0

    expected = {f"{shard}/{key}" for shard in ("cam-a/000", "cam-b/000") for key in ("000000", "000001")}
    expected |= {f"mixed/{key}" for key in ("000000", "000001", "000002")}
    assert raw_keys(raw) == expected
    committed = Counter(key for _, record in open_reader(uri).order() for key in record.keys)
    assert set(committed) == expected and set(committed.values()) == {1}
    trained = Counter(key for batch in BatchReader(open_reader(uri), 2, on_read=lambda p: None) for key in batch.keys)
    assert trained == committed  # the trainer's reader sees every sample once, under its own key

    report = json.loads((run_dir / "precompute_report.json").read_text())
    assert report["status"] == "done" and report["rejected"] == {"duplicate_key": 2}
    rejects = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    assert [(r["key"], r["position"], r["reason"]) for r in rejects] == [
        ("mixed/000000", 2, "duplicate_key"),
        ("mixed/000002", 4, "duplicate_key"),
    ]
    assert "rejects.jsonl" in log.read_text()  # the summary line names the list


class Crash(Exception):
    """Stands in for a process dying at a commit."""


class CrashingWindow(Writer):
    """A real window writer that dies at its `at`-th publish, before writing the shard's data."""

    def __init__(self, *args, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.publishes = at, 0

    def publish(self, record, data):
        self.publishes += 1
        if self.publishes == self.at:
            raise Crash(f"before the data of shard {record.seq}")
        return super().publish(record, data)


def test_a_restart_rereads_a_partial_shard_and_lists_its_rejects_once(tmp_path, media, tiny_model_factory):
    """The raw shard is half committed when the producer dies; the restart re-reads it, skips the
    committed samples, rejects the same bad ones again and lists each of them once."""
    clip = media.encode_clip(media.gray_frames(12))
    caption = b"a gray fade"
    members = []
    for key in ("g0", "nocap", "g1", "g0", "g2", "g3", "g4"):  # g0 twice: the second is a duplicate_key
        members += [(f"{key}.mp4", clip)] + ([] if key == "nocap" else [(f"{key}.txt", caption)])
    raw = tmp_path / "raw"
    raw.mkdir()
    media.write_tar(raw / "r.tar", members)
    uri = str(tmp_path / "window")
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            tiny_model_factory("ltx-video"),
            raw,
            tmp_path / "run",
            uri,
            window={"size": "keep"},
            precompute={"workers": 0},
        )
    )
    first = Precompute(config)
    first.window = CrashingWindow(Storage(uri), "keep", 0.01, 30.0, at=2)  # shard 0 = g0, g1; dies before shard 1
    with pytest.raises(Crash):
        first.run()
    report = Precompute(config).run()

    assert (
        report.resumed_at == 1
        and report.skipped_committed == 2
        and report.rejected == {"missing_caption": 1, "duplicate_key": 1}
    )
    committed = Counter(key for _, record in open_reader(uri).order() for key in record.keys)
    assert committed == Counter({f"r/g{i}": 1 for i in range(5)})
    lines = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["key"], r["position"], r["reason"]) for r in lines] == [
        ("r/nocap", 1, "missing_caption"),
        ("r/g0", 3, "duplicate_key"),
    ]
