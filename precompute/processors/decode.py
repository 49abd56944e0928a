"""Probe a clip and decode only the frames shown at given times (PyAV).

Decode is what limits precompute throughput, so decode_at never decodes a whole file: it seeks to
the keyframe before the first wanted time, decodes forward, and stops at the first frame past the
last wanted time. Frames are chosen by timestamp (the frame on screen at time t is the last one
whose presentation time is <= t), which works for 25, 29.97 and variable frame rate alike.

Sizes in VideoInfo are as displayed: a phone clip stored 1920x1080 with a 90 degree display
rotation reports height 1920, width 1080, and decode_at returns its frames upright.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

from .errors import SampleError


@dataclass(frozen=True)
class VideoInfo:
    """What bucket choice and frame sampling need to know about a clip.

    `duration` runs to the end of the last frame (frames / fps for a constant rate), `height` and
    `width` are after rotation, and `rotation` is the display rotation in degrees counter-clockwise
    (0, 90, 180 or 270), the convention of FFmpeg's display matrix and PyAV's VideoFrame.rotation.
    """

    fps: float
    frames: int
    duration: float
    height: int
    width: int
    rotation: int


def _open(video: bytes) -> av.container.InputContainer:
    if not video:
        raise SampleError("empty_video", "the video file has 0 bytes")
    try:
        return av.open(io.BytesIO(video), mode="r")
    except (av.FFmpegError, OSError, ValueError) as err:
        raise SampleError("corrupt_video", f"PyAV cannot open it: {err}") from None


def _video_stream(container) -> av.video.stream.VideoStream:
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["nothing"]
        raise SampleError("no_video_stream", f"the file holds {', '.join(kinds)} but no video stream")
    return container.streams.video[0]


def _normalize_rotation(degrees: float | int | None) -> int:
    """Any display angle -> 0, 90, 180 or 270 counter-clockwise (odd angles snap to the nearest)."""
    return int(round((degrees or 0) / 90.0)) % 4 * 90


def _frame_pts(frame) -> int | None:
    return frame.pts if frame.pts is not None else frame.dts


def _scan_packets(video: bytes) -> tuple[int, float]:
    """(frames, duration) by demuxing without decoding, for containers whose header lacks them."""
    count, end = 0, None
    with _open(video) as container:
        stream = _video_stream(container)
        origin = stream.start_time or 0
        for packet in container.demux(stream):
            pts = packet.pts if packet.pts is not None else packet.dts
            if packet.size == 0 or pts is None:
                continue
            count += 1
            stop = float((pts - origin + (packet.duration or 0)) * stream.time_base)
            end = stop if end is None else max(end, stop)
    return count, end or 0.0


def probe(video: bytes) -> VideoInfo:
    """Frame rate, frame count, duration, displayed size and rotation of a clip.

    Decodes the first frame too, so a file that opens but cannot be decoded fails here, before any
    work is spent on it. Raises SampleError("corrupt_video" | "no_video_stream" | "empty_video").
    """
    with _open(video) as container:
        stream = _video_stream(container)
        try:
            first = next(iter(container.decode(stream)), None)
        except av.FFmpegError as err:
            raise SampleError("corrupt_video", f"cannot decode the first frame: {err}") from None
        if first is None:
            raise SampleError("empty_video", "the video stream has no decodable frames")
        frames = stream.frames or 0
        duration = float(stream.duration * stream.time_base) if stream.duration else 0.0
        rate = stream.average_rate or stream.guessed_rate
    if frames <= 0 or duration <= 0:
        frames, duration = _scan_packets(video)
    if frames <= 0 or duration <= 0:
        raise SampleError("empty_video", f"the video stream has {frames} frames over {duration:.3f}s")
    fps = float(rate) if rate else frames / duration
    rotation = _normalize_rotation(first.rotation)
    height, width = first.height, first.width
    if rotation in (90, 270):
        height, width = width, height
    return VideoInfo(fps=fps, frames=frames, duration=duration, height=height, width=width, rotation=rotation)


def _pick_frames(container, stream, wanted: list[float], fps: float, stats: dict,
                 allow_seek: bool) -> list | None:
    """The frame shown at each of the sorted `wanted` times; None if a seek landed past the first.

    A frame is kept until the next decoded frame starts after a wanted time, so decoding stops
    one frame past the last wanted time (plus the decoder's reorder delay).
    """
    base, origin = stream.time_base, stream.start_time or 0
    # Slack for stored timestamps, which are rounded to the nearest tick (a millisecond in mkv):
    # half a tick, never more than a quarter frame, plus float noise.
    tol = min(0.5 * float(base), 0.25 / fps if fps > 0 else 1.0) + 1e-6
    seek = allow_seek and wanted[0] - tol > 0
    if seek:
        container.seek(origin + int((wanted[0] - tol) / base), stream=stream, backward=True)
        stats["seeks"] += 1
    picked: list = []
    shown = None  # the frame on screen at the current decode position
    for packet in container.demux(stream):
        stats["packets"] += 1
        for frame in packet.decode():
            stats["frames"] += 1
            pts = _frame_pts(frame)
            if pts is None:
                continue
            start = float((pts - origin) * base)
            if shown is None and seek and start > wanted[0] + tol:
                return None  # the demuxer seeked past the target (rare index quirk): caller retries
            while shown is not None and len(picked) < len(wanted) and start > wanted[len(picked)] + tol:
                picked.append(shown)
            if len(picked) == len(wanted):
                return picked
            shown = frame
    if shown is None:
        raise SampleError("empty_video", "no frame could be decoded at the wanted times")
    return picked + [shown] * (len(wanted) - len(picked))  # times in the last frame


def _to_rgb(frame, rotation: int) -> np.ndarray:
    rgb = frame.to_ndarray(format="rgb24")
    return np.rot90(rgb, k=rotation // 90) if rotation else rgb


def decode_at(video: bytes, times: list[float], info: VideoInfo, stats: dict | None = None) -> np.ndarray:
    """(F, H, W, 3) uint8 RGB: the frame shown at each time (seconds from the clip's start).

    Seeks to the first needed time and decodes forward only as far as the last one. `stats`, if
    given, receives counts {"packets", "frames", "seeks"} of this call, for tests and benchmarks.
    Raises SampleError("corrupt_video" | "no_video_stream" | "empty_video").
    """
    if not times:
        raise ValueError("decode_at needs at least one time")
    order = sorted(range(len(times)), key=times.__getitem__)
    wanted = [float(times[i]) for i in order]
    counts = {"packets": 0, "frames": 0, "seeks": 0}
    with _open(video) as container:
        stream = _video_stream(container)
        try:
            picked = _pick_frames(container, stream, wanted, info.fps, counts, allow_seek=True)
            if picked is None:  # the seek overshot: decode from the start instead
                container.seek(0, stream=stream, backward=True)
                picked = _pick_frames(container, stream, wanted, info.fps, counts, allow_seek=False)
            out = None
            previous = None
            for position, frame in enumerate(picked):
                if frame is not previous:  # a frame shown at several times is converted once
                    rgb, previous = _to_rgb(frame, info.rotation), frame
                if out is None:
                    out = np.empty((len(times), *rgb.shape), dtype=np.uint8)
                if rgb.shape != out.shape[1:]:
                    raise SampleError("frame_size_changes", f"frames of {rgb.shape} and {out.shape[1:]} in one clip")
                out[order[position]] = rgb
        except av.FFmpegError as err:
            raise SampleError("corrupt_video", f"decoding failed: {err}") from None
    if stats is not None:
        stats.update(counts)
    return out
