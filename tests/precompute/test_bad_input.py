"""Every kind of bad input is skipped and counted by its reason; none escapes as another exception.

Each case writes a real tar holding one good sample next to one bad one, runs it through the same
steps the service runs (iter_raw_samples, then prepare_sample, counting SampleError reasons), and
checks the count. An exception other than SampleError fails the test by propagating.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from vt.precompute.processors import SampleError, prepare_sample
from vt.precompute.sources import iter_raw_samples
from vt.shared.buckets import Bucket

BUCKETS = [Bucket(9, 64, 96), Bucket(17, 64, 96)]
FPS = 8.0


def count_reasons(shard: Path) -> tuple[Counter, list[str]]:
    """What the service would report for this shard: "ok" or the reason, per sample; and the keys."""
    counts: Counter = Counter()
    keys = []
    for raw in iter_raw_samples(str(shard)):
        keys.append(raw.key)
        try:
            prepared = prepare_sample(raw, BUCKETS, FPS)
        except SampleError as err:
            assert err.reason and " " not in err.reason, err.reason
            counts[err.reason] += 1
        else:
            assert prepared.video.shape[0] == 3
            counts["ok"] += 1
    return counts, keys


def _bad_members(case: str, media, good_clip: bytes) -> list[tuple[str, bytes]]:
    """The members of the bad sample, keyed 'bad'."""
    caption = [("bad.txt", b"a caption")]
    if case == "corrupt_video":
        return [("bad.mp4", b"\x00junk-not-a-container\xff" * 200)] + caption  # fixed: random bytes can parse as audio
    if case == "truncated_mp4":
        return [("bad.mp4", good_clip[: len(good_clip) // 2])] + caption
    if case == "empty_video":
        return [("bad.mp4", b"")] + caption
    if case == "no_video_stream":
        return [("bad.mp4", media.audio_only_mp4())] + caption
    if case == "too_short":
        return [("bad.mp4", media.encode_clip(media.gray_frames(5), fps=8.0))] + caption  # 5 < 9 frames
    if case == "missing_caption":
        return [("bad.mp4", good_clip)]
    if case == "empty_caption":
        return [("bad.mp4", good_clip), ("bad.txt", b" \n\t ")]
    if case == "caption_not_utf8":
        return [("bad.mp4", good_clip), ("bad.txt", "café".encode("latin-1"))]
    if case == "caption_bad_json":
        return [("bad.mp4", good_clip), ("bad.json", b'{"caption": "unclosed')]
    if case == "json_without_caption":
        return [("bad.mp4", good_clip), ("bad.json", json.dumps({"width": 96}).encode())]
    if case == "missing_video":
        return caption
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("corrupt_video", "corrupt_video"),
        ("truncated_mp4", "corrupt_video"),
        ("empty_video", "empty_video"),
        ("no_video_stream", "no_video_stream"),
        ("too_short", "too_short"),
        ("missing_caption", "missing_caption"),
        ("empty_caption", "empty_caption"),
        ("caption_not_utf8", "caption_not_utf8"),
        ("caption_bad_json", "caption_bad_json"),
        ("json_without_caption", "missing_caption"),
        ("missing_video", "missing_video"),
    ],
)
def test_bad_sample_is_counted_by_reason(case, reason, media, good_clip, tmp_path):
    shard = media.write_tar(
        tmp_path / "raw.tar",
        [("good.mp4", good_clip), ("good.txt", b"a gray fade")] + _bad_members(case, media, good_clip),
    )
    counts, keys = count_reasons(shard)
    assert keys == ["good", "bad"]
    assert counts == Counter({"ok": 1, reason: 1})


def _three_sample_tar(media, good_clip: bytes, path: Path) -> Path:
    members = []
    for key in ("a", "b", "c"):
        members += [(f"{key}.mp4", good_clip), (f"{key}.txt", f"sample {key}".encode())]
    return media.write_tar(path, members)


def test_tar_cut_inside_a_member(media, good_clip, tmp_path):
    shard = _three_sample_tar(media, good_clip, tmp_path / "raw.tar")
    cut = media.member_offset(shard, "b.mp4") + 512 + len(good_clip) // 2  # halfway into b's video
    shard.write_bytes(shard.read_bytes()[:cut])
    samples = list(iter_raw_samples(str(shard)))
    assert [(s.key, s.error) for s in samples] == [("a", None), ("b", "truncated_tar")]
    assert count_reasons(shard)[0] == Counter({"ok": 1, "truncated_tar": 1})


def test_tar_cut_between_members(media, good_clip, tmp_path):
    """No end-of-archive marker: the complete samples come out, then the damage is reported."""
    shard = _three_sample_tar(media, good_clip, tmp_path / "raw.tar")
    shard.write_bytes(shard.read_bytes()[: media.member_offset(shard, "c.mp4")])
    samples = [(s.key, s.error) for s in iter_raw_samples(str(shard))]
    assert samples == [("a", None), ("b", None), ("b", "truncated_tar")]


def test_tar_cut_between_a_video_and_its_caption(media, good_clip, tmp_path):
    """The sample that lost its caption to the cut is dropped, not miscounted as missing_caption."""
    shard = _three_sample_tar(media, good_clip, tmp_path / "raw.tar")
    shard.write_bytes(shard.read_bytes()[: media.member_offset(shard, "b.txt")])
    assert [(s.key, s.error) for s in iter_raw_samples(str(shard))] == [("a", None), ("b", "truncated_tar")]


def test_tar_with_a_garbage_header(media, good_clip, tmp_path):
    shard = _three_sample_tar(media, good_clip, tmp_path / "raw.tar")
    data = bytearray(shard.read_bytes())
    start = media.member_offset(shard, "b.mp4")
    data[start : start + 512] = np.random.default_rng(0).integers(1, 255, 512, dtype=np.uint8).tobytes()
    shard.write_bytes(bytes(data))
    assert [(s.key, s.error) for s in iter_raw_samples(str(shard))] == [("a", None), ("a", "truncated_tar")]


@pytest.mark.parametrize("content", [b"", b"this is not a tar file at all" * 40])
def test_file_that_is_not_a_tar(content, tmp_path):
    shard = tmp_path / "raw.tar"
    shard.write_bytes(content)
    assert [(s.key, s.error) for s in iter_raw_samples(str(shard))] == [("", "truncated_tar")]


def test_missing_shard_is_a_storage_error_not_a_sample(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(iter_raw_samples(str(tmp_path / "gone.tar")))
