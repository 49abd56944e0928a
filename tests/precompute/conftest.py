"""Fixtures for stage 1 input tests: the raw tars cut from the real clips, and small-file builders.

Bad and unusual inputs are made here with PyAV and tarfile, in the test run itself, so every
case is a real file that real libraries wrote (or a real file damaged on purpose).
"""

from __future__ import annotations

import io
import tarfile
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest


@pytest.fixture(scope="session")
def raw_tars(raw_shards) -> list[Path]:
    """The tars of the shared raw_shards folder (13 samples of 1.5 s cut from the real clips)."""
    return sorted(raw_shards.glob("*.tar"))


def encode_clip(
    frames: np.ndarray,
    fps: float = 8.0,
    pts_seconds: list[float] | None = None,
    rotation: int = 0,
    gop: int | None = None,
    container_format: str = "mp4",
) -> bytes:
    """(F, H, W, 3) uint8 -> h264 bytes in mp4 (or "matroska"); `pts_seconds` gives each frame its
    own time (variable frame rate).

    Encoded with qp 0, so solid gray frames come back within a level or two and tests can
    recognise each frame by its colour.
    """
    buf = io.BytesIO()
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(buf, mode="w", format=container_format) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        stream.codec_context.options = {"qp": "0", "preset": "ultrafast"}
        if gop:
            stream.codec_context.gop_size = gop
        if rotation:
            stream.set_display_rotation(rotation)
        time_base = Fraction(1, 1000) if pts_seconds is not None else 1 / rate
        if pts_seconds is not None:
            stream.codec_context.time_base = time_base
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            at = pts_seconds[index] if pts_seconds is not None else index / rate
            frame.pts, frame.time_base = int(round(Fraction(at) / time_base)), time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def gray_frames(count: int, height: int = 64, width: int = 96) -> np.ndarray:
    """Frame i is a solid gray of level 10 + 10 * i (i < 25), so a decoded frame tells its index."""
    levels = (10 + 10 * np.arange(count)).clip(0, 255).astype(np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (count, height, width, 3)).copy()


def frame_index(frame: np.ndarray) -> int:
    """Inverse of gray_frames for one decoded frame."""
    return int(round((float(frame.mean()) - 10) / 10))


def audio_only_mp4() -> bytes:
    """An mp4 holding one AAC audio stream and no video."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        for index in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, index * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar of (name, data) members in the given order."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def member_offset(path: Path, name: str) -> int:
    """Byte offset of a member's header in an uncompressed tar."""
    with tarfile.open(path) as tar:
        return tar.getmember(name).offset


@pytest.fixture(scope="session")
def good_clip() -> bytes:
    """A small valid clip: 24 gray frames at 8 fps (3 s), 64x96."""
    return encode_clip(gray_frames(24), fps=8.0)


@pytest.fixture(scope="session")
def media():
    """The builders above, for test modules (a second conftest module cannot be imported by name)."""
    return SimpleNamespace(
        encode_clip=encode_clip,
        gray_frames=gray_frames,
        frame_index=frame_index,
        audio_only_mp4=audio_only_mp4,
        write_tar=write_tar,
        member_offset=member_offset,
    )
