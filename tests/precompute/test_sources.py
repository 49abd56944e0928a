"""Real clips -> raw webdataset shards -> RawSamples, from local disk and from S3 (moto)."""

from __future__ import annotations

import io
import json
import re
import tarfile

import pytest
import webdataset as wds
from fetch_sample_clips import CLIPS, fetch_clips
from make_sample_shards import make_sample_shards

from vt.precompute.processors import probe
from vt.precompute.sources import RawSample, iter_raw_samples, list_raw_shards, split_for_rank

# 1.5 s pieces: bigbuckbunny 5.28 s -> 3, bikes 10 s -> 6, each carphone 4.004 s -> 2
EXPECTED_KEYS = (
    [f"bigbuckbunny-{i:03d}" for i in range(3)]
    + [f"bikes-{i:03d}" for i in range(6)]
    + [f"carphone_distorted-{i:03d}" for i in range(2)]
    + [f"carphone_pristine-{i:03d}" for i in range(2)]
)


def test_fetch_clips_is_idempotent(clips_dir):
    before = {p.name: p.stat().st_mtime_ns for p in clips_dir.iterdir()}
    assert sorted(before) == sorted(CLIPS)
    again = fetch_clips(clips_dir)  # no cache given: must not need the network when clips exist
    assert [p.name for p in again] == list(CLIPS)
    assert {p.name: p.stat().st_mtime_ns for p in again} == before


def test_sample_shards_are_read_by_webdataset(raw_tars):
    assert [p.name for p in raw_tars] == [f"raw-{i:06d}.tar" for i in range(4)]  # 13 samples, 4 a tar
    dataset = wds.WebDataset([str(p) for p in raw_tars], shardshuffle=False, empty_check=False)
    samples = list(dataset)
    assert [s["__key__"] for s in samples] == EXPECTED_KEYS
    for sample in samples:
        assert set(sample) >= {"mp4", "txt"}
        caption = sample["txt"].decode("utf-8")
        assert len(caption.split()) >= 5, caption
        info = probe(sample["mp4"])
        assert info.duration == pytest.approx(1.5, abs=0.05)  # 1.5 s, give or take a frame
        assert max(info.height, info.width) <= 256 and info.height % 2 == 0 and info.width % 2 == 0
    by_clip = {s["__key__"].rsplit("-", 1)[0]: probe(s["mp4"]) for s in samples}
    assert by_clip["bigbuckbunny"].width / by_clip["bigbuckbunny"].height == pytest.approx(16 / 9, rel=0.02)
    assert by_clip["bikes"].width / by_clip["bikes"].height == pytest.approx(640 / 272, rel=0.02)


def test_iter_raw_samples_matches_webdataset(raw_tars):
    ours = [s for shard in raw_tars for s in iter_raw_samples(str(shard))]
    theirs = list(wds.WebDataset([str(p) for p in raw_tars], shardshuffle=False, empty_check=False))
    assert all(s.error is None for s in ours)
    assert [(s.key, s.video, s.caption) for s in ours] == [
        (t["__key__"], t["mp4"], t["txt"].decode("utf-8")) for t in theirs
    ]
    assert {s.shard for s in ours} == {str(p) for p in raw_tars}


def test_json_captions(clips_dir, tmp_path):
    shards = make_sample_shards(
        [clips_dir / "carphone_distorted.mp4"],
        tmp_path,
        seconds=1.0,
        captions={"carphone_distorted": "a man on a phone"},
        caption_format="json",
    )
    with tarfile.open(shards[0]) as tar:
        assert tar.getnames()[:2] == ["carphone_distorted-000.mp4", "carphone_distorted-000.json"]
        assert json.load(tar.extractfile("carphone_distorted-000.json")) == {"caption": "a man on a phone"}
    samples = list(iter_raw_samples(str(shards[0])))
    assert len(samples) == 4 and all(s.caption == "a man on a phone" and s.error is None for s in samples)


def test_text_field_and_keys_with_folders(media, good_clip, tmp_path):
    shard = media.write_tar(
        tmp_path / "s.tar",
        [
            ("part/a.mp4", good_clip),
            ("part/a.json", json.dumps({"text": " two words "}).encode()),
            ("c.mp4", good_clip),
            ("c.txt", b"cat"),
        ],
    )
    samples = list(iter_raw_samples(str(shard)))
    assert [(s.key, s.caption, s.error) for s in samples] == [("part/a", "two words", None), ("c", "cat", None)]


def test_list_raw_shards_forms(raw_tars, tmp_path):
    folder = raw_tars[0].parent
    names = [str(p) for p in raw_tars]
    assert list_raw_shards(str(folder)) == names
    assert list_raw_shards(str(folder / "*.tar")) == names
    assert list_raw_shards(str(folder / "raw-{000000..000003}.tar")) == names
    assert list_raw_shards(names[1]) == [names[1]]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(empty))):
        list_raw_shards(str(empty))
    with pytest.raises(FileNotFoundError, match="nowhere/x.tar"):
        list_raw_shards(str(tmp_path / "nowhere/x.tar"))


def test_split_for_rank_is_disjoint_complete_and_deterministic():
    shards = [f"s3://b/raw-{i:06d}.tar" for i in range(7)]
    parts = [split_for_rank(list(reversed(shards)), rank, 3) for rank in range(3)]
    assert parts == [split_for_rank(shards, rank, 3) for rank in range(3)]  # input order does not matter
    assert sorted(sum(parts, [])) == shards and [len(p) for p in parts] == [3, 2, 2]
    assert split_for_rank(shards[:1], 1, 2) == []
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        split_for_rank(shards, 2, 2)


@pytest.mark.s3
def test_s3_source_yields_the_same_samples_as_local(raw_tars, s3_bucket):
    import fsspec

    fs = fsspec.filesystem("s3")
    for path in raw_tars:
        fs.put_file(str(path), f"{s3_bucket}/data/raw/{path.name}")
    fs.pipe_file(f"{s3_bucket}/data/notes.txt", b"not a shard")
    urls = list_raw_shards(f"{s3_bucket}/data")
    assert urls == [f"{s3_bucket}/data/raw/{p.name}" for p in raw_tars]
    assert list_raw_shards(f"{s3_bucket}/data/raw/*.tar") == urls

    def rows(samples: list[RawSample]):
        return [(s.key, s.caption, s.video, s.error) for s in samples]

    remote = [s for url in urls for s in iter_raw_samples(url)]
    local = [s for p in raw_tars for s in iter_raw_samples(str(p))]
    assert len(remote) == len(EXPECTED_KEYS) and rows(remote) == rows(local)
    assert remote[0].shard == urls[0]
    with pytest.raises(FileNotFoundError, match=f"{s3_bucket}/missing"):
        list_raw_shards(f"{s3_bucket}/missing")


def test_truncated_tar_on_s3_is_reported_not_raised(media, good_clip, s3_bucket):
    import fsspec

    members = [(f"k{i}.mp4", good_clip) for i in range(3)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            caption = b"a gray fade"
            info = tarfile.TarInfo(name.replace(".mp4", ".txt"))
            info.size = len(caption)
            tar.addfile(info, io.BytesIO(caption))
    data = buf.getvalue()
    url = f"{s3_bucket}/cut.tar"
    fsspec.filesystem("s3").pipe_file(url, data[: int(len(data) * 0.6)])
    samples = list(iter_raw_samples(url))
    assert [s.error for s in samples][-1] == "truncated_tar"
    assert all(s.error is None for s in samples[:-1]) and len(samples) >= 2
