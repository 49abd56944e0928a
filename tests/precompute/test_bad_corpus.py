"""A crawl-like corpus through the real service: oddly encoded clips are committed, bad ones counted.

The corpus is built here with PyAV: the same gray fade (frame i has level 10 + 10 i) encoded as
h264, VP9 (webm), 10-bit HEVC, AV1 (SVT-AV1), MPEG-4 part 2 (avi), rotated by display metadata,
at a variable frame rate and at an odd size (175x143), next to every kind of bad sample (corrupt,
truncated, empty, audio-only, too short, captions missing / empty / not UTF-8 / bad JSON) and a
tar cut short. `Precompute` on the tiny LTX-Video model must commit exactly the good samples, in
the buckets their shapes call for, count each bad one under its reason, list each bad one with its
reason in rejects.jsonl, and leave no shard file without its record. Decoding of the odd clips is
checked frame by frame, by gray level.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from vt.precompute.processors import Clip, prepare_sample, sample_times
from vt.precompute.service import Precompute, TooManyFailures
from vt.precompute.sources import RawSample
from vt.shared.buckets import Bucket
from vt.shared.config import load_config
from vt.shared.shards import decode_shard
from vt.shared.window import open_reader

from helpers.cli_runs import write_config

BUCKETS = ["9x64x96", "9x96x64", "9x64x64", "17x64x96"]
FPS = 8.0
# Fixed junk, not random bytes: a random file now and then looks like some audio format to FFmpeg.
NOT_A_VIDEO = b"this is not a video file. " * 40
VFR_STARTS = [0.0, 0.1, 0.15, 0.5, 0.55, 1.2, 1.25, 1.6]  # irregular gaps, as phones record
# The frame on screen at t = 0, 1/8, ... 1 s: the last one that started at or before t.
VFR_EXPECTED = [0, 1, 2, 2, 3, 4, 4, 4, 4]


def encode_with(
    codec: str,
    frames: np.ndarray,
    container_format: str,
    pix_fmt: str = "yuv420p",
    options: dict | None = None,
    fps: float = FPS,
) -> bytes:
    """(F, H, W, 3) uint8 RGB -> a file made by `codec` in `container_format`, in memory. The calling thread keeps its
    scheduling policy: SVT-AV1 (libsvtav1) sets the thread that opens it to SCHED_FIFO at priority 99 where it may
    (as root), which every process started from it then inherits; a spinning one starved a whole suite run."""
    policy, priority = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        return _encode(codec, frames, container_format, pix_fmt, options, fps)
    finally:
        os.sched_setscheduler(0, policy, priority)


def _encode(codec, frames, container_format, pix_fmt, options, fps) -> bytes:
    buf = io.BytesIO()
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(buf, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], pix_fmt
        stream.codec_context.options = options or {}
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts, frame.time_base = index, 1 / rate
            container.mux(stream.encode(frame.reformat(format=pix_fmt)))
        container.mux(stream.encode(None))
    return buf.getvalue()


def odd_clips(media) -> dict[str, tuple[bytes, str, list[int]]]:
    """key -> (video bytes, expected bucket, expected frame index at each sampled time)."""
    fade = media.gray_frames(24)  # 3 s at 8 fps: enough for the 17-frame bucket
    all17 = list(range(17))
    return {
        "h264": (media.encode_clip(fade), "17x64x96", all17),
        "vp9": (
            encode_with("libvpx-vp9", fade, "webm", options={"deadline": "realtime", "cpu-used": "8"}),
            "17x64x96",
            all17,
        ),
        "hevc-10bit": (
            encode_with(
                "libx265", fade, "mp4", "yuv420p10le", {"preset": "ultrafast", "x265-params": "log-level=error"}
            ),
            "17x64x96",
            all17,
        ),
        "av1": (encode_with("libsvtav1", fade, "mp4", options={"preset": "12"}), "17x64x96", all17),
        "mpeg4-avi": (encode_with("mpeg4", fade, "avi", options={"qscale": "2"}), "17x64x96", all17),
        # Stored 64x96 and shown turned by 90 degrees: a portrait clip, for the portrait bucket.
        "rotated": (media.encode_clip(fade, rotation=90), "9x96x64", list(range(9))),
        "vfr": (media.encode_clip(media.gray_frames(len(VFR_STARTS)), pts_seconds=VFR_STARTS), "9x64x96", VFR_EXPECTED),
        # yuv420p at odd sizes is fine for VP9; aspect 1.22 is a hair nearer 1:1 than 3:2.
        "odd-175x143": (
            encode_with(
                "libvpx-vp9", media.gray_frames(24, 143, 175), "webm", options={"deadline": "realtime", "cpu-used": "8"}
            ),
            "9x64x64",
            list(range(9)),
        ),
    }


def frame_indices(video: torch.Tensor) -> list[int]:
    """Gray level of each frame of a (3, F, H, W) tensor in [-1, 1] -> its index in the fade."""
    levels = (video.mean(dim=(0, 2, 3)) + 1) * 127.5
    return [int(round((float(level) - 10) / 10)) for level in levels]


@pytest.fixture(scope="module")
def clips(media):
    return odd_clips(media)


@pytest.mark.parametrize("key", ["h264", "vp9", "hevc-10bit", "av1", "mpeg4-avi", "rotated", "vfr", "odd-175x143"])
def test_odd_clip_decodes_to_the_right_frames(clips, key):
    video, bucket, expected = clips[key]
    sample = prepare_sample(RawSample(key, "corpus.tar", video, "a gray fade"), [Bucket.parse(b) for b in BUCKETS], FPS)
    assert sample.bucket.name == bucket
    assert sample.video.shape == (3, sample.bucket.frames, sample.bucket.height, sample.bucket.width)
    assert frame_indices(sample.video) == expected
    # A flat gray frame stays flat: no green or pink cast from a wrong pixel format or bit depth.
    assert float((sample.video.amax(dim=0) - sample.video.amin(dim=0)).abs().max()) < 0.05


def test_rotated_clip_is_upright_in_its_bucket(media):
    """A marker in the stored top-left corner is shown bottom-left after a 90 degree turn."""
    stored = np.zeros((9, 64, 96, 3), np.uint8)
    stored[:, :32, :48] = 255
    video = media.encode_clip(stored, fps=FPS, rotation=90)
    sample = prepare_sample(RawSample("r", "x", video, "c"), [Bucket(9, 96, 64)], FPS)
    frame = sample.video[:, 0].mean(0)  # (96, 64)
    assert frame[48:, :32].mean() > 0.9 and frame[:48].mean() < -0.9 and frame[48:, 32:].mean() < -0.9


def test_long_clip_is_not_decoded_whole(media):
    """30 s of video for a 9-frame bucket: one open, no seek from the start, stop after 1 s."""
    video = media.encode_clip(media.gray_frames(240), fps=8.0)
    with Clip(video) as clip:
        frames = clip.frames_at(sample_times(clip.info, FPS, 9), size=(64, 96))
        assert clip.info.frames == 240
        assert [media.frame_index(f) for f in frames] == list(range(9))
        assert clip.stats["seeks"] == 0 and clip.stats["frames"] <= 12, clip.stats


def build_corpus(folder: Path, media, clips) -> tuple[set[str], Counter, dict[str, str]]:
    """Two raw tars: every odd clip between the bad samples, and a tar cut inside its third sample.

    Returns the keys that must be committed (`<tar name>/<key>`), the rejection counts the report
    must show and the reason each rejected key must be listed with.
    """
    good = media.encode_clip(media.gray_frames(24))
    caption = b"a gray fade"
    members: list[tuple[str, bytes]] = []
    for key, (video, _, _) in clips.items():
        ext = {"vp9": "webm", "odd-175x143": "webm", "mpeg4-avi": "avi"}.get(key, "mp4")
        members += [(f"{key}.{ext}", video), (f"{key}.txt", caption)]
    members += [("json-caption.mp4", good), ("json-caption.json", json.dumps({"caption": "a fade"}).encode())]
    bad = {
        "not-a-video": ([("not-a-video.mp4", NOT_A_VIDEO), ("not-a-video.txt", caption)], "corrupt_video"),
        "cut-mp4": ([("cut-mp4.mp4", good[: len(good) // 2]), ("cut-mp4.txt", caption)], "corrupt_video"),
        "empty": ([("empty.mp4", b""), ("empty.txt", caption)], "empty_video"),
        "audio-only": ([("audio-only.mp4", media.audio_only_mp4()), ("audio-only.txt", caption)], "no_video_stream"),
        "short": ([("short.mp4", media.encode_clip(media.gray_frames(5))), ("short.txt", caption)], "too_short"),
        "no-caption": ([("no-caption.mp4", good)], "missing_caption"),
        "blank-caption": ([("blank-caption.mp4", good), ("blank-caption.txt", b" \n ")], "empty_caption"),
        "latin1-caption": (
            [("latin1-caption.mp4", good), ("latin1-caption.txt", "café".encode("latin-1"))],
            "caption_not_utf8",
        ),
        "bad-json": ([("bad-json.mp4", good), ("bad-json.json", b'{"caption": "unclosed')], "caption_bad_json"),
    }
    # Interleave: bad samples between good ones, as they come in a crawl.
    pairs = [members[i : i + 2] for i in range(0, len(members), 2)]
    mixed: list[tuple[str, bytes]] = []
    for index, (sample_members, _) in enumerate(bad.values()):
        mixed += (pairs[index] if index < len(pairs) else []) + sample_members
    for leftover in pairs[len(bad) :]:
        mixed += leftover
    media.write_tar(folder / "crawl-000000.tar", mixed)

    cut = media.write_tar(
        folder / "crawl-000001.tar",
        [
            (f"{key}.{ext}", data)
            for key in ("tar-a", "tar-b", "tar-c")
            for ext, data in (("mp4", good), ("txt", caption))
        ],
    )
    cut.write_bytes(cut.read_bytes()[: media.member_offset(cut, "tar-c.mp4") + 512 + len(good) // 2])

    expected_keys = {f"crawl-000000/{key}" for key in [*clips, "json-caption"]} | {
        "crawl-000001/tar-a",
        "crawl-000001/tar-b",
    }
    expected_reasons = Counter(reason for _, reason in bad.values()) + Counter({"truncated_tar": 1})
    rejects = {f"crawl-000000/{key}": reason for key, (_, reason) in bad.items()}
    rejects["crawl-000001/tar-c"] = "truncated_tar"  # the sample being read when the tar ended
    return expected_keys, expected_reasons, rejects


def committed_shards(uri: str) -> list[tuple[object, dict, list[str]]]:
    """(record, tensors, keys) of every shard producer 0 committed, read through its record."""
    window = open_reader(uri)
    out = []
    for seq in range(window.next_seq(0)):
        record = window.record(0, seq)
        tensors, keys, _ = decode_shard(window.read_shard(record))  # checks size and sha256
        out.append((record, tensors, keys))
    return out


def test_bad_corpus_through_the_service(tmp_path, media, clips, tiny_model_factory):
    raw = tmp_path / "raw"
    raw.mkdir()
    expected_keys, expected_reasons, expected_rejects = build_corpus(raw, media, clips)
    uri = str(tmp_path / "window")
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            tiny_model_factory("ltx-video"),
            raw,
            tmp_path / "run",
            uri,
            buckets={"sizes": BUCKETS, "fps": FPS},
            window={"size": "keep"},
            precompute={"workers": 1, "samples_per_shard": 2, "encode_batch": 2},
        )
    )

    report = Precompute(config).run()

    saved = json.loads((tmp_path / "run" / "precompute_report.json").read_text())
    assert saved["rejected"] == dict(sorted(expected_reasons.items()))
    assert saved["committed"] == len(expected_keys)
    assert saved["seen"] == len(expected_keys) + sum(expected_reasons.values())
    assert report.committed == len(expected_keys)
    # Every rejected sample is listed once, with its raw shard, reason and a detail, and the summary names the list.
    lines = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert {line["key"]: line["reason"] for line in lines} == expected_rejects and len(lines) == len(expected_rejects)
    for line in lines:
        assert line["shard"] == str(raw / f"{line['key'].split('/')[0]}.tar") and line["epoch"] == 0
        assert line["detail"] and isinstance(line["position"], int)
    assert saved["rejects_file"] == str(tmp_path / "run" / "rejects.jsonl")
    assert f"listed in {tmp_path / 'run' / 'rejects.jsonl'}" in report.summary_line()

    shards = committed_shards(uri)
    keys = [key for _, _, shard_keys in shards for key in shard_keys]
    assert sorted(keys) == sorted(expected_keys)  # each good sample exactly once, no bad one
    bucket_of = {key: record.bucket for record, _, shard_keys in shards for key in shard_keys}
    expected_buckets = {f"crawl-000000/{key}": bucket for key, (_, bucket, _) in clips.items()}
    assert {key: bucket_of[key] for key in expected_buckets} == expected_buckets
    for record, tensors, shard_keys in shards:
        assert record.keys == shard_keys and 1 <= len(shard_keys) <= 2
        for name, tensor in tensors.items():
            assert tensor.shape[0] == len(shard_keys), name
            assert torch.isfinite(tensor.float()).all(), name
    # No partial shard: every data file in the window is named by a record, and vice versa.
    window = open_reader(uri)
    assert sorted(window.storage.list("data")) == sorted(record.data for record, _, _ in shards)


def test_a_hundred_failures_in_a_row_stop_the_run(tmp_path, media, tiny_model_factory):
    """99 bad, 1 good (the run goes on), then 100 bad: the run stops, the report says why."""
    good = media.encode_clip(media.gray_frames(12))
    members = [(f"nocap-{i:03d}.mp4", good) for i in range(99)]
    members += [("good.mp4", good), ("good.txt", b"a gray fade")]
    for i in range(100):
        members += [(f"junk-{i:03d}.mp4", NOT_A_VIDEO), (f"junk-{i:03d}.txt", b"a caption")]
    members += [("never-reached.mp4", good), ("never-reached.txt", b"a gray fade")]
    raw = tmp_path / "raw"
    raw.mkdir()
    media.write_tar(raw / "junk-000000.tar", members)
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            tiny_model_factory("ltx-video"),
            raw,
            tmp_path / "run",
            str(tmp_path / "window"),
            buckets={"sizes": BUCKETS, "fps": FPS},
            window={"size": "keep"},
            precompute={"workers": 0},
        )
    )
    assert config.precompute.max_consecutive_failures == 100

    with pytest.raises(TooManyFailures) as failure:
        Precompute(config).run()

    message = str(failure.value)
    assert "100 samples in a row failed" in message
    assert "junk-099" in message and "corrupt_video" in message  # the last one and why
    assert "data.raw" in message  # what to check
    report = json.loads((tmp_path / "run" / "precompute_report.json").read_text())
    assert report["rejected"] == {"corrupt_video": 100, "missing_caption": 99}
    assert report["seen"] == 200 and report["committed"] == 0
    assert open_reader(str(tmp_path / "window")).storage.list("commits") == []
