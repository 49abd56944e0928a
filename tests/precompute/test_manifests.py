"""Clip manifests as raw input (precompute/manifests.py): clips cut by timestamps from the real clips, decoded
by seeking; vt's JSON lines and parquet (NeMo Curator's output: test_curator_output.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vt.precompute.media_ref import MediaRef
from vt.precompute.processors.decode import Clip
from vt.precompute.sources import iter_raw_samples, list_raw_shards, shard_names

# clip file, start, end, caption: spans of the real clips (all > 1.125 s, the 9-frame bucket at 8 fps)
SPANS = [
    ("bigbuckbunny.mp4", 0.0, 1.5, "a rabbit wakes up"),
    ("bigbuckbunny.mp4", 2.0, 3.5, "a rabbit stretches"),
    ("bikes.mp4", 6.0, 8.0, "bikes race downhill"),
    ("carphone_pristine.mp4", 1.0, 2.5, "a man on the phone"),
    ("bikes.mp4", 8.5, None, "bikes, to the end"),
]


def write_manifest(path, clips_dir, extra: list[dict] = ()) -> list[dict]:
    records = [
        {"video": str(clips_dir / name), "start": start, "end": end, "caption": caption, "source": "test"}
        for name, start, end, caption in SPANS
    ]
    records[0]["key"] = "first"
    records = [*records, *extra]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return records


def samples(uri: str) -> list:
    units = list_raw_shards(uri)
    names = shard_names(units)
    return [raw for unit in units for raw in iter_raw_samples(unit, names[unit])]


def test_a_span_decodes_the_frames_of_the_whole_file_at_its_times_by_seeking(clips_dir):
    path = clips_dir / "bikes.mp4"
    with Clip(path.read_bytes()) as whole:
        expected = whole.frames_at([8.0, 8.5, 9.0], (64, 96))
        total = whole.info.frames
    with Clip(MediaRef(str(path), 8.0, 9.5)) as span:
        assert span.info.duration == pytest.approx(1.5) and span.info.frames == round(total * 1.5 / 10)
        got = span.frames_at([0.0, 0.5, 1.0], (64, 96))
        assert span.stats["packets"] < total / 2  # a seek to the keyframe before 8 s, not a decode from 0
    assert np.array_equal(got, expected)


def test_a_manifest_lists_units_and_yields_clips_with_their_spans_and_metadata(clips_dir, tmp_path):
    manifest = tmp_path / "clips.jsonl"
    write_manifest(
        manifest,
        clips_dir,
        extra=[
            {"video": "missing.mp4", "caption": "gone"},
            {"video": str(clips_dir / "bikes.mp4"), "start": 3, "end": 2, "caption": "backwards"},
        ],
    )
    with manifest.open("a") as out:
        out.write("{not json\n")
    raws = samples(str(manifest))
    assert [r.sample_id for r in raws][:3] == ["clips/first", "clips/000001", "clips/000002"]
    good = [r for r in raws if r.error is None]
    assert [(r.video.start, r.video.end, r.caption) for r in good] == [(s, e, c) for _, s, e, c in SPANS] + [
        (0.0, None, "gone")
    ]
    assert good[0].clip == {
        "uri": str(clips_dir / "bigbuckbunny.mp4"),
        "start": 0.0,
        "end": 1.5,
        "meta": {"source": "test"},
    }
    assert [r.error for r in raws if r.error] == ["bad_span", "manifest_bad_record"]
    # the missing file is found when decoding: a reject of its own, not a crash
    missing = next(r for r in raws if r.caption == "gone")
    assert missing.video == MediaRef(str(tmp_path / "missing.mp4"))  # relative to the manifest's folder


def test_a_parquet_manifest_reads_as_its_json_lines(clips_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = write_manifest(tmp_path / "clips.jsonl", clips_dir)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "clips.parquet")
    as_lines = [(r.key, r.video, r.caption) for r in samples(str(tmp_path / "clips.jsonl"))]
    assert [(r.key, r.video, r.caption) for r in samples(str(tmp_path / "clips.parquet"))] == as_lines


def test_clips_cut_from_a_manifest_train_and_bad_records_are_rejects(clips_dir, tmp_path, tiny_model_factory):
    """Stage 1 over a manifest of spans (a missing file and a span past its video's end among them), then a few
    steps of training on the window: every good clip is one sample, with its record in the shard."""
    from vt.precompute.service import Precompute
    from vt.shared.config import load_config
    from vt.shared.shards import decode_shard
    from vt.shared.window import open_reader
    from vt.train.trainer import Trainer

    from helpers.cli_runs import write_config

    manifest = tmp_path / "clips.jsonl"
    write_manifest(
        manifest,
        clips_dir,
        extra=[
            {"video": "missing.mp4", "caption": "gone"},
            {"video": str(clips_dir / "bikes.mp4"), "start": 30.0, "caption": "past the end"},
        ],
    )
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            tiny_model_factory("wan"),
            manifest,
            tmp_path / "run",
            str(tmp_path / "window"),
            model={"family": "wan"},
            buckets={"sizes": ["9x64x96"]},
            precompute={"workers": 0},
            window={"size": "keep"},
            train={"max_steps": 3, "checkpoint_every": 0},
        )
    )
    Precompute(config).run()
    assert Trainer(config).run()["steps"] == 3
    window = open_reader(str(tmp_path / "window"))
    keys, clips = [], {}
    for _, record in window.order():
        _, shard_keys, meta = decode_shard(window.read_shard(record))
        keys += shard_keys
        clips.update(meta["clips"])
    assert sorted(keys) == sorted(["clips/first", *(f"clips/{i:06d}" for i in range(1, len(SPANS)))])
    assert clips["clips/000002"] == {
        "uri": str(clips_dir / "bikes.mp4"),
        "start": 6.0,
        "end": 8.0,
        "meta": {"source": "test"},
    }
    rejects = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["key"], r["reason"]) for r in rejects) == [
        (f"clips/{len(SPANS):06d}", "missing_video"),
        (f"clips/{len(SPANS) + 1:06d}", "span_outside_video"),
    ]
