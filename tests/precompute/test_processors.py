"""Decode, sample and fit on the real clips: exact probe values, pixel-equal seeking, crop not stretch."""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import av
import numpy as np
import pytest
import torch

from vt.precompute.processors import (
    PreparedSample,
    SampleError,
    VideoInfo,
    decode_at,
    fit_to_bucket,
    prepare_sample,
    probe,
    sample_times,
    usable_frames,
)
from vt.precompute.sources import RawSample, iter_raw_samples
from vt.shared.buckets import Bucket


def _read(clips_dir, name: str) -> bytes:
    return (clips_dir / f"{name}.mp4").read_bytes()


def _full_decode(video: bytes) -> tuple[list[float], list[np.ndarray]]:
    """Every frame of the clip, with its time from the clip's start: the reference for decode_at."""
    import io

    with av.open(io.BytesIO(video)) as container:
        stream = container.streams.video[0]
        origin = stream.start_time or 0
        frames = list(container.decode(stream))
        times = [float((f.pts - origin) * stream.time_base) for f in frames]
        return times, [f.to_ndarray(format="rgb24") for f in frames]


def _shown_at(times: list[float], frames: list[np.ndarray], t: float) -> np.ndarray:
    """The last frame starting at or before t."""
    return frames[max(i for i, start in enumerate(times) if start <= t + 1e-6)]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("bigbuckbunny", (25.0, 132, 5.28, 720, 1280, 1.0)),
        ("bikes", (25.0, 250, 10.0, 272, 640, 1.0)),
        # stored 176x144 with pixels 128/117 as wide as tall (CIF at 4:3): shown 193x144
        ("carphone_pristine", (30000 / 1001, 120, 4.004, 144, 193, 128 / 117)),
        ("carphone_distorted", (30000 / 1001, 120, 4.004, 144, 193, 128 / 117)),
    ],
)
def test_probe_real_clips(clips_dir, name, expected):
    info = probe(_read(clips_dir, name))
    fps, frames, duration, height, width, sar = expected
    assert info == VideoInfo(
        fps=pytest.approx(fps),
        frames=frames,
        duration=pytest.approx(duration),
        height=height,
        width=width,
        rotation=0,
        sample_aspect_ratio=pytest.approx(sar),
    )


@pytest.mark.parametrize("name, start", [("bikes", 0.0), ("bikes", 3.3), ("carphone_pristine", 0.7)])
def test_decode_at_equals_full_decode(clips_dir, name, start):
    video = _read(clips_dir, name)
    info = probe(video)
    times = sample_times(info, fps=8.0, frames=17, start=start)
    all_times, all_frames = _full_decode(video)
    stored = all_frames[0].shape[:2]  # carphone's pixels are not square: compare at the stored size
    got = decode_at(video, times, info, size=stored)
    assert got.shape == (17, *stored, 3) and got.dtype == np.uint8
    for t, frame in zip(times, got):
        assert np.array_equal(frame, _shown_at(all_times, all_frames, t)), f"frame at {t:.3f}s differs"


def test_decode_at_seeks_instead_of_decoding_the_whole_clip(clips_dir):
    """A window near the end of bikes.mp4 (250 frames, keyframes ~2 s apart) decodes a fraction."""
    video = _read(clips_dir, "bikes")
    info = probe(video)
    times = sample_times(info, fps=8.0, frames=9, start=8.8)
    stats: dict = {}
    got = decode_at(video, times, info, stats=stats)
    assert stats["seeks"] == 1
    assert stats["frames"] < info.frames / 3 and stats["packets"] < info.frames / 3, stats
    all_times, all_frames = _full_decode(video)
    assert all(np.array_equal(f, _shown_at(all_times, all_frames, t)) for t, f in zip(times, got))


def test_decode_at_keeps_the_callers_order_and_repeats(media):
    video = media.encode_clip(media.gray_frames(16), fps=8.0)
    info = probe(video)
    got = decode_at(video, [1.0, 0.0, 0.5, 0.5, 1.9], info)
    assert [media.frame_index(f) for f in got] == [8, 0, 4, 4, 15]


def test_variable_frame_rate_is_sampled_by_timestamp(media):
    starts = [0.0, 0.1, 0.15, 0.5, 0.55, 1.2, 1.25, 2.0]  # irregular gaps, as phones record
    video = media.encode_clip(media.gray_frames(8), pts_seconds=starts)
    info = probe(video)
    assert info.frames == 8 and info.duration > 2.0
    got = decode_at(video, [0.05, 0.12, 0.3, 0.52, 0.9, 1.22, 1.3, 2.01], info)
    assert [media.frame_index(f) for f in got] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_29_97_fps_times_pick_the_right_frames(media):
    """At the source's own 29.97 fps, sampling must not drop or repeat frames by rounding."""
    video = media.encode_clip(media.gray_frames(24), fps=30000 / 1001)
    info = probe(video)
    got = decode_at(video, sample_times(info, fps=30000 / 1001, frames=24), info)
    assert [media.frame_index(f) for f in got] == list(range(24))


def test_matroska_without_frame_count_and_with_millisecond_timestamps(media):
    """mkv stores no frame count and rounds times to 1 ms: probe counts packets, picks stay exact."""
    video = media.encode_clip(media.gray_frames(24), fps=30000 / 1001, container_format="matroska")
    info = probe(video)
    assert info.frames == 24 and info.duration == pytest.approx(24 * 1001 / 30000, abs=0.002)
    got = decode_at(video, sample_times(info, fps=30000 / 1001, frames=24), info)
    assert [media.frame_index(f) for f in got] == list(range(24))


@pytest.mark.parametrize("rotation, corner", [(90, "bottom-left"), (270, "top-right"), (180, "bottom-right")])
def test_rotation_metadata_is_applied(media, rotation, corner):
    coded = np.zeros((4, 32, 64, 3), np.uint8)
    coded[:, :16, :32] = 255  # white top-left quarter as stored
    video = media.encode_clip(coded, fps=8.0, rotation=rotation)
    info = probe(video)
    assert info.rotation == rotation
    assert (info.height, info.width) == ((64, 32) if rotation in (90, 270) else (32, 64))
    frame = decode_at(video, [0.0], info)[0].mean(axis=2)
    h, w = frame.shape
    quarters = {
        "top-left": frame[: h // 2, : w // 2],
        "top-right": frame[: h // 2, w // 2 :],
        "bottom-left": frame[h // 2 :, : w // 2],
        "bottom-right": frame[h // 2 :, w // 2 :],
    }
    assert {k for k, q in quarters.items() if q.mean() > 200} == {corner}


def test_sample_times_and_usable_frames():
    info = VideoInfo(fps=30000 / 1001, frames=120, duration=4.004, height=144, width=176, rotation=0)
    assert usable_frames(info, 8.0) == 33  # 0, 0.125, ..., 4.0 < 4.004
    times = sample_times(info, 8.0, 33)
    assert times[0] == 0.0 and times[-1] == pytest.approx(4.0) and np.allclose(np.diff(times), 0.125)
    assert sample_times(info, 8.0, 9, start=1.0)[0] == 1.0
    with pytest.raises(SampleError) as err:
        sample_times(info, 8.0, 34)
    assert err.value.reason == "too_short" and "4.004" in err.value.detail
    exact = VideoInfo(fps=25.0, frames=25, duration=1.0, height=8, width=8, rotation=0)
    assert usable_frames(exact, 25.0) == 25 and usable_frames(exact, 8.0) == 8


def test_fit_to_bucket_shape_and_range(clips_dir):
    video = _read(clips_dir, "bigbuckbunny")
    info = probe(video)
    frames = decode_at(video, sample_times(info, 8.0, 9), info)
    out = fit_to_bucket(frames, Bucket(9, 64, 96))
    assert out.shape == (3, 9, 64, 96) and out.dtype == torch.float32
    assert -1.0 <= out.min() < -0.5 and 0.5 < out.max() <= 1.0  # the cartoon spans dark to bright


def test_fit_to_bucket_crops_never_stretches():
    """A 2:1 frame with a centered black square into a 1:1 bucket: the square stays square."""
    frame = np.full((1, 64, 128, 3), 255, np.uint8)
    frame[:, 16:48, 48:80] = 0  # 32x32 square in the middle
    frame[:, :, :16] = (255, 0, 0)  # red strip at the far left: cropped away, never squeezed in
    out = fit_to_bucket(frame, Bucket(1, 32, 32))  # resize to 32x64, crop the middle 32 columns
    gray = out[:, 0].mean(0)
    dark = (gray < -0.5).nonzero()
    rows = dark[:, 0].max() - dark[:, 0].min() + 1
    cols = dark[:, 1].max() - dark[:, 1].min() + 1
    assert rows == cols == 16, (rows, cols)  # a stretch to 32x32 would give 16 rows x 8 columns
    assert dark[:, 0].min() == 8 and dark[:, 1].min() == 8  # centered
    red = (out[0, 0] > 0.5) & (out[1, 0] < -0.5)
    assert not red.any()


def test_fit_to_bucket_rejects_the_wrong_frame_count():
    with pytest.raises(ValueError, match="9x32x32 needs 9 frames"):
        fit_to_bucket(np.zeros((5, 32, 32, 3), np.uint8), Bucket(9, 32, 32))


BUCKETS = [Bucket(9, 64, 96), Bucket(9, 96, 64), Bucket(9, 64, 64), Bucket(17, 64, 96)]


def test_prepare_sample_on_raw_tars(raw_tars):
    samples = [s for s in iter_raw_samples(str(raw_tars[0]))][:4]
    prepared = [prepare_sample(s, BUCKETS, fps=8.0) for s in samples]
    # 1.5 s at 8 fps = 12 frames: too few for 17, so the wide clips land in 9x64x96
    assert [p.bucket for p in prepared] == [Bucket(9, 64, 96)] * 4
    assert all(p.video.shape == (3, 9, 64, 96) and p.caption == s.caption for p, s in zip(prepared, samples))
    assert [p.key for p in prepared] == [f"raw-000000/{s.key}" for s in samples]  # raw shard name / key


def test_prepare_sample_runs_in_a_worker_process(raw_tars):
    """Arguments, results and errors cross a process boundary (spawn: see the note below)."""
    # Not fork: a child forked after the parent ran a torch op hangs in its first torch op
    # (GNU OpenMP's thread pool does not survive fork), so the service must spawn its workers.
    samples = list(iter_raw_samples(str(raw_tars[2])))[:2]  # a wide and a 176x144 clip
    bad = RawSample(key="bad", shard="x", video=b"not a video", caption="c")
    work = partial(prepare_sample, buckets=BUCKETS, fps=8.0)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        remote = list(pool.map(work, samples))
        error = pool.submit(work, bad).exception()
    local = [work(s) for s in samples]
    assert all(isinstance(r, PreparedSample) for r in remote)
    assert [r.bucket for r in remote] == [Bucket(9, 64, 96), Bucket(9, 64, 64)]
    assert all(torch.equal(a.video, b.video) and a.bucket == b.bucket for a, b in zip(remote, local))
    assert isinstance(error, SampleError) and error.reason == "corrupt_video"
    again = pickle.loads(pickle.dumps(error))
    assert (again.reason, again.detail) == (error.reason, error.detail)
