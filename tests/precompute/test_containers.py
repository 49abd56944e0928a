"""Containers beyond mp4/webm/mkv, and anamorphic clips, through the real decode and the real service.

Each clip is the same gray fade (frame i has level 10 + 6 i, 24 fps, 1.5 s) encoded by PyAV into
another container under that container's usual extension: MPEG transport streams (.ts, .m2ts),
MPEG program streams (.mpg, .vob), an MPEG-2 elementary stream (.m2v), Flash (.flv, .f4v), 3GPP
(.3gp), Ogg (.ogv), Windows Media (.wmv, .asf), MXF and YUV4MPEG (.y4m). Every one must decode to
the right frames and be committed by `Precompute`, none rejected as missing_video.

An anamorphic clip (stored 64x64, sample aspect ratio 2:1, shown 128x64) must be bucketed and
fitted by its displayed shape: a red stripe over the stored left quarter stays a quarter of the
displayed width, not stretched.
"""

from __future__ import annotations

import io
import json
from fractions import Fraction

import av
import numpy as np
import pytest

from vt.precompute.processors import prepare_sample, probe
from vt.precompute.service import Precompute
from vt.precompute.sources import VIDEO_EXTS, RawSample, iter_raw_samples
from vt.shared.buckets import Bucket
from vt.shared.config import load_config
from vt.shared.window import open_reader

from helpers.cli_runs import write_config

FPS = 24  # a rate MPEG-1/2 accept
FRAMES = 36
SAMPLED = [3 * i for i in range(9)]  # the frames shown at 0, 1/8, ... 1 s

# extension -> (codec, PyAV container format, codec options)
CONTAINERS = {
    "ts": ("libx264", "mpegts", {"qp": "0"}),
    "m2ts": ("mpeg2video", "mpegts", {"qscale": "2"}),
    "mpg": ("mpeg1video", "mpeg", {"qscale": "2"}),
    "vob": ("mpeg1video", "vob", {"qscale": "2"}),  # FFmpeg's vob muxer leaves a timestamp gap in MPEG-2
    "m2v": ("mpeg2video", "mpeg2video", {"qscale": "2"}),
    "flv": ("flv", "flv", {"qscale": "2"}),
    "f4v": ("libx264", "f4v", {"qp": "0"}),
    "3gp": ("libx264", "3gp", {"qp": "0"}),
    "ogv": ("libvpx", "ogg", {"crf": "4", "b": "2M"}),
    "wmv": ("wmv2", "asf", {"qscale": "2"}),
    "asf": ("msmpeg4", "asf", {"qscale": "2"}),
    "mxf": ("mpeg2video", "mxf", {"qscale": "2"}),
    "y4m": ("rawvideo", "yuv4mpegpipe", {}),
}


def encode(
    frames: np.ndarray,
    codec: str,
    container_format: str,
    options: dict | None = None,
    fps: int = FPS,
    sar: Fraction | None = None,
) -> bytes:
    """(F, H, W, 3) uint8 RGB -> `codec` in `container_format`, in memory; `sar` marks pixels non-square."""
    buf = io.BytesIO()
    rate = Fraction(fps)
    with av.open(buf, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        stream.codec_context.options = options or {}
        if sar is not None:
            stream.codec_context.sample_aspect_ratio = sar
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts, frame.time_base = index, 1 / rate
            container.mux(stream.encode(frame.reformat(format="yuv420p")))
        container.mux(stream.encode(None))
    return buf.getvalue()


def fade() -> np.ndarray:
    levels = (10 + 6 * np.arange(FRAMES)).astype(np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (FRAMES, 64, 96, 3)).copy()


def split_clip(sar: Fraction | None) -> bytes:
    """Stored 64x64: the left quarter red, the rest blue; 12 frames at 8 fps."""
    stored = np.zeros((12, 64, 64, 3), np.uint8)
    stored[:, :, :16, 0] = 255
    stored[:, :, 16:, 2] = 255
    return encode(stored, "libx264", "matroska", {"qp": "0"}, fps=8, sar=sar)


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    frames = fade()
    return {ext: encode(frames, codec, fmt, options) for ext, (codec, fmt, options) in CONTAINERS.items()}


def test_the_extension_list_covers_ffmpeg_video_and_no_images():
    assert set(CONTAINERS) <= set(VIDEO_EXTS) and {"mts", "mpeg", "3g2", "mov", "webm"} <= set(VIDEO_EXTS)
    assert not {"jpg", "jpeg", "png", "gif", "webp", "txt", "json"} & set(VIDEO_EXTS)


@pytest.mark.parametrize("ext", sorted(CONTAINERS))
def test_container_in_a_tar_decodes_to_the_right_frames(clips, ext, media, tmp_path):
    shard = media.write_tar(tmp_path / "x.tar", [(f"k.{ext}", clips[ext]), ("k.txt", b"a gray fade")])
    (raw,) = iter_raw_samples(str(shard))
    assert raw.error is None and raw.video == clips[ext]
    sample = prepare_sample(raw, [Bucket(9, 64, 96)], 8.0)
    levels = (sample.video.mean(dim=(0, 2, 3)) + 1) * 127.5
    got = [(float(level) - 10) / 6 for level in levels]
    assert np.allclose(got, SAMPLED, atol=1.0), got  # lossy codecs: within one frame's level step


def test_anamorphic_clip_reads_back_its_sample_aspect_ratio():
    info = probe(split_clip(Fraction(2, 1)))
    assert (info.height, info.width, info.sample_aspect_ratio) == (64, 128, 2.0)
    square = probe(split_clip(None))
    assert (square.height, square.width, square.sample_aspect_ratio) == (64, 64, 1.0)


@pytest.mark.parametrize(
    "buckets, bucket, red_columns",
    [
        # shown 128x64 (aspect 2): the 2:1 bucket, no crop; red is the left 32 of 128 columns
        (["9x64x64", "9x64x96", "9x64x128"], "9x64x128", 32),
        # only 3:2: covered at 64x128, 16 columns cut off each side, so 16 red columns remain
        (["9x64x96"], "9x64x96", 16),
    ],
)
def test_anamorphic_clip_is_bucketed_and_fitted_by_its_displayed_shape(buckets, bucket, red_columns):
    sample = prepare_sample(
        RawSample("k", "x.tar", split_clip(Fraction(2, 1)), "a split"), [Bucket.parse(b) for b in buckets], 8.0
    )
    assert sample.bucket.name == bucket
    frame = sample.pixels[:, 0].float()  # (3, H, W), first frame
    red = (frame[0] > 128) & (frame[2] < 128)
    columns = red.float().mean(dim=0)  # share of red rows per column
    assert bool((columns[: red_columns - 2] > 0.95).all()) and bool((columns[red_columns + 2 :] < 0.05).all())


def test_containers_and_an_anamorphic_clip_through_the_service(tmp_path, media, clips, tiny_model_factory):
    raw = tmp_path / "raw"
    raw.mkdir()
    members = []
    for ext, video in clips.items():
        members += [(f"{ext}-clip.{ext}", video), (f"{ext}-clip.txt", b"a gray fade")]
    members += [("anamorphic.mkv", split_clip(Fraction(2, 1))), ("anamorphic.txt", b"a split")]
    media.write_tar(raw / "formats.tar", members)
    uri = str(tmp_path / "window")
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            tiny_model_factory("ltx-video"),
            raw,
            tmp_path / "run",
            uri,
            buckets={"sizes": ["9x64x96", "9x64x64", "9x64x128"], "fps": 8.0},
            window={"size": "keep"},
            precompute={"workers": 1},
        )
    )
    report = Precompute(config).run()

    assert dict(report.rejected) == {}
    bucket_of = {key: record.bucket for _, record in open_reader(uri).order() for key in record.keys}
    assert set(bucket_of) == {f"formats/{ext}-clip" for ext in clips} | {"formats/anamorphic"}
    assert bucket_of["formats/anamorphic"] == "9x64x128"
    assert {bucket_of[f"formats/{ext}-clip"] for ext in clips} == {"9x64x96"}
    assert (tmp_path / "run" / "rejects.jsonl").read_text() == ""
    assert json.loads((tmp_path / "run" / "precompute_report.json").read_text())["committed"] == len(clips) + 1
