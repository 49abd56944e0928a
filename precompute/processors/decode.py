"""Probe a clip and decode only the frames shown at given times (PyAV), in one pass over the file.

Decode is what limits precompute throughput, so a clip is opened once (`Clip`): the probe decodes
its first frame, and decoding the wanted frames continues from there when they start at the
beginning, or seeks to the keyframe before the first wanted time otherwise. It stops at the first
frame past the last wanted time, so a long video is never decoded whole. Frames are chosen by
timestamp (the frame on screen at time t is the last one whose presentation time is <= t), which
works for 25, 29.97 and variable frame rate alike. Times count from the stream's start time, or from
its first frame where the container states none (raw MPEG-1/2 video, .m2v).

Sizes in VideoInfo are the displayed size: the sample aspect ratio (SAR, pixel shape) applied to
the width, then the rotation. An anamorphic clip stored 64x64 with SAR 2:1 reports height 64,
width 128 (carphone's 128/117 turns 176x144 into 193x144); a phone clip stored 1920x1080 with a 90
degree display rotation reports height 1920, width 1080, and frames come back upright. So bucket
choice and fitting see the picture as a player shows it, never stretched. A SAR outside
[1/10, 10] is taken for broken metadata and ignored (square pixels). Frames are scaled by FFmpeg
(swscale) while being converted to RGB, straight to the size the caller asks for (in displayed
pixels), so a 720p clip bound for a 64x96 bucket never exists as full-size RGB or float in memory.

A clip may also be a span of a file that stays where it is (`MediaRef`, from a clip manifest): the file
is read through fsspec as PyAV seeks, time 0 is the span's start, its duration the span's, and decoding
seeks there before its first frame, so a clip cut from a long video never reads the video whole.

Decoding is single-threaded per clip: throughput comes from several decode worker processes
(precompute.workers), and FFmpeg's own threads would only compete with them and the encoder.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from ..media_ref import MediaRef, open_media
from .errors import SampleError


@dataclass(frozen=True)
class VideoInfo:
    """What bucket choice and frame sampling need to know about a clip.

    `duration` runs to the end of the last frame (frames / fps for a constant rate), `height` and
    `width` are the displayed size (stored width times `sample_aspect_ratio`, then rotated), and
    `rotation` is the display rotation in degrees counter-clockwise (0, 90, 180 or 270), the
    convention of FFmpeg's display matrix and PyAV's VideoFrame.rotation.
    """

    fps: float
    frames: int
    duration: float
    height: int
    width: int
    rotation: int
    sample_aspect_ratio: float = 1.0  # width of a stored pixel over its height, as applied


_SAR_RANGE = (0.1, 10.0)  # outside: broken metadata, pixels taken as square


def _open(video: bytes | MediaRef) -> av.container.InputContainer:
    if not isinstance(video, MediaRef) and not video:
        raise SampleError("empty_video", "the video file has 0 bytes")
    try:
        handle = open_media(video)
    except FileNotFoundError:
        raise SampleError("missing_video", f"{video.uri} is not there") from None
    try:
        return av.open(handle, mode="r")
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


def _sample_aspect(stream) -> float:
    """The stream's SAR (container's, else the codec's, as FFmpeg guesses it); 1 when unset or absurd."""
    sar = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    value = float(sar) if sar else 1.0
    return value if _SAR_RANGE[0] <= value <= _SAR_RANGE[1] else 1.0


def _frame_pts(frame) -> int | None:
    return frame.pts if frame.pts is not None else frame.dts


def _scan_packets(video: bytes | MediaRef, origin: int) -> tuple[int, float]:
    """(frames, duration from `origin`) by demuxing without decoding, for containers whose header lacks them."""
    count, end = 0, None
    with _open(video) as container:
        stream = _video_stream(container)
        for packet in container.demux(stream):
            pts = packet.pts if packet.pts is not None else packet.dts
            if packet.size == 0 or pts is None:
                continue
            count += 1
            stop = float((pts - origin + (packet.duration or 0)) * stream.time_base)
            end = stop if end is None else max(end, stop)
    return count, end or 0.0


class Clip:
    """One clip opened for probing and decoding: `info`, then `frames_at(times, size)`.

    A context manager; the container is closed on exit. Raises SampleError("corrupt_video" |
    "no_video_stream" | "empty_video") on opening, since the probe decodes the first frame: a file
    that opens but cannot be decoded fails before any more work is spent on it.
    """

    def __init__(self, video: bytes | MediaRef):
        self._video = video
        span = video if isinstance(video, MediaRef) else MediaRef("", 0.0)
        self._container = _open(video)
        self.stats = {"packets": 0, "frames": 0, "seeks": 0}
        self._reformatter = VideoReformatter()  # keeps its scaler between frames: 3x cheaper than anew
        try:
            self._stream = _video_stream(self._container)
            self._stream.codec_context.thread_count = 1  # see the module docstring
            self._frames = self._decode_forward()
            try:
                first = next(self._frames, None)
            except av.FFmpegError as err:
                raise SampleError("corrupt_video", f"cannot decode the first frame: {err}") from None
            if first is None:
                raise SampleError("empty_video", "the video stream has no decodable frames")
            self._first = first
            start = self._stream.start_time
            origin = start if start is not None else (_frame_pts(first) or 0)  # the stream's start, in ticks
            self._origin = origin + round(span.start / self._stream.time_base)  # time 0: the span's start
            self._pending = [first]  # decoded, not yet looked at by frames_at
            self._at_start = span.start == 0  # a span's first frame is a seek away
            try:
                self.info = self._probe(first, span)
            except av.FFmpegError as err:  # a header without frame count or duration: the packets are scanned
                raise SampleError("corrupt_video", f"cannot read its packets: {err}") from None
        except BaseException:
            self._container.close()
            raise

    @property
    def data(self) -> bytes | MediaRef:
        """The file's bytes or its reference (the sound decoder opens it again, processors/sound.py)."""
        return self._video

    @property
    def origin_seconds(self) -> float:
        """Where the clip's time 0 (its video stream's start) is on the container's timeline, in seconds."""
        return float(self._origin * self._stream.time_base)

    def __enter__(self) -> "Clip":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._container.close()

    def _decode_forward(self):
        for packet in self._container.demux(self._stream):
            self.stats["packets"] += 1
            for frame in packet.decode():
                self.stats["frames"] += 1
                yield frame

    def _probe(self, first, span: MediaRef) -> VideoInfo:
        stream = self._stream
        frames = stream.frames or 0
        duration = float(stream.duration * stream.time_base) if stream.duration else 0.0
        if frames <= 0 or duration <= 0:
            frames, duration = _scan_packets(self._video, self._origin - round(span.start / stream.time_base))
        if frames <= 0 or duration <= 0:
            raise SampleError("empty_video", f"the video stream has {frames} frames over {duration:.3f}s")
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else frames / duration
        if span.start or span.end is not None:  # a span of it: its own duration and frames
            if span.start >= duration:
                raise SampleError(
                    "span_outside_video", f"the span starts at {span.start:g}s; the video lasts {duration:.3f}s"
                )
            whole = duration
            duration = min(duration, span.end if span.end is not None else duration) - span.start
            frames = max(1, round(frames * duration / whole))
        rotation = _normalize_rotation(first.rotation)
        sar = _sample_aspect(stream)
        height, width = first.height, max(1, round(first.width * sar))  # displayed: pixels made square
        if rotation in (90, 270):
            height, width = width, height
        return VideoInfo(
            fps=fps,
            frames=frames,
            duration=duration,
            height=height,
            width=width,
            rotation=rotation,
            sample_aspect_ratio=sar,
        )

    def _restart(self, seconds: float, count: bool) -> None:
        """Seek to the keyframe at or before `seconds` from the start; decoding resumes there."""
        stream = self._stream
        self._container.seek(self._origin + int(seconds / stream.time_base), stream=stream, backward=True)
        self._frames, self._pending, self._at_start = self._decode_forward(), [], False
        if count:
            self.stats["seeks"] += 1

    def _pick(self, wanted: list[float], allow_seek: bool) -> list | None:
        """The frame shown at each of the sorted `wanted` times; None if a seek landed past the first.

        A frame is kept until the next decoded frame starts after a wanted time, so decoding stops
        one frame past the last wanted time (plus the decoder's reorder delay).
        """
        stream, fps = self._stream, self.info.fps
        base, origin = stream.time_base, self._origin
        # Slack for stored timestamps, which are rounded to the nearest tick (a millisecond in mkv):
        # half a tick, never more than a quarter frame, plus float noise.
        tol = min(0.5 * float(base), 0.25 / fps if fps > 0 else 1.0) + 1e-6
        seek = allow_seek and wanted[0] - tol > 0
        if seek:
            self._restart(wanted[0] - tol, count=True)
        elif not self._at_start:
            self._restart(0.0, count=False)
        self._at_start = False
        frames, self._pending = itertools.chain(self._pending, self._frames), []
        picked: list = []
        shown = None  # the frame on screen at the current decode position
        for frame in frames:
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

    def _to_rgb(self, frame, height: int, width: int) -> np.ndarray:
        """One frame as upright (height, width, 3) uint8 RGB, scaled by swscale if needed.

        (height, width) is in displayed pixels, so scaling the stored frame to it also undoes a
        non-square sample aspect ratio.
        """
        rotation = self.info.rotation
        stored_h, stored_w = (width, height) if rotation in (90, 270) else (height, width)
        shrink = stored_h <= frame.height and stored_w <= frame.width
        # One scaler thread: swscale's default (one per core) costs more to start than a small
        # frame takes to scale, and the worker processes already use the cores. The frame's own
        # colour range (full-range phone video) and matrix (BT.709 for HD) give the right RGB.
        rgb = self._reformatter.reformat(
            frame,
            format="rgb24",
            width=stored_w,
            height=stored_h,
            interpolation="AREA" if shrink else "BICUBIC",
            threads=1,
            src_color_range=frame.color_range,
        ).to_ndarray()
        return np.rot90(rgb, k=rotation // 90) if rotation else rgb

    def frames_at(self, times: list[float], size: tuple[int, int] | None = None) -> np.ndarray:
        """(F, H, W, 3) uint8 RGB: the frame shown at each time (seconds from the clip's start).

        `size` is the (height, width) to scale the displayed frame to (aspect is the caller's
        business: fit_bucket asks for the size that covers a bucket); default: as displayed
        (`info.height`, `info.width`, so an anamorphic clip comes out widened, not stored-size).
        Raises SampleError("corrupt_video" | "empty_video" | "frame_size_changes").
        """
        if not times:
            raise ValueError("frames_at needs at least one time")
        height, width = size or (self.info.height, self.info.width)
        if height < 1 or width < 1:
            raise ValueError(f"size must be positive (height, width), got {size}")
        order = sorted(range(len(times)), key=times.__getitem__)
        wanted = [float(times[i]) for i in order]
        try:
            picked = self._pick(wanted, allow_seek=True)
            if picked is None:  # the seek overshot: decode from the start instead
                picked = self._pick(wanted, allow_seek=False)
            out = np.empty((len(times), height, width, 3), dtype=np.uint8)
            coded = (self._first.height, self._first.width)
            previous = rgb = None
            for position, frame in enumerate(picked):
                if frame is not previous:  # a frame shown at several times is converted once
                    if (frame.height, frame.width) != coded:
                        raise SampleError(
                            "frame_size_changes", f"frames of {coded} and {(frame.height, frame.width)} in one clip"
                        )
                    rgb, previous = self._to_rgb(frame, height, width), frame
                out[order[position]] = rgb
        except av.FFmpegError as err:
            raise SampleError("corrupt_video", f"decoding failed: {err}") from None
        return out

    def scan(self, size: tuple[int, int]) -> Iterator[tuple[float, np.ndarray]]:
        """Every frame of the clip once, in order: (seconds from the clip's start, (H, W, 3) uint8 RGB at `size`).

        One forward decode (a scene detector's pass, at a small `size`); `frames_at` afterwards seeks as usual.
        """
        if not self._at_start:
            self._restart(0.0, count=False)
        frames, self._pending, self._at_start = itertools.chain(self._pending, self._frames), [], False
        base, fps = float(self._stream.time_base), self.info.fps
        tol = min(0.5 * base, 0.25 / fps if fps > 0 else 1.0) + 1e-6  # as _pick's
        try:
            for frame in frames:
                pts = _frame_pts(frame)
                if pts is None:
                    continue
                seconds = (pts - self._origin) * base
                if seconds < -tol:  # before a span's start: the seek lands on the keyframe before it
                    continue
                if seconds >= self.info.duration - tol:
                    return
                yield max(0.0, seconds), self._to_rgb(frame, *size)
        except av.FFmpegError as err:
            raise SampleError("corrupt_video", f"decoding failed: {err}") from None

    def span(self, start: float, end: float) -> "ClipSpan":
        """The part of the clip from `start` to `end` seconds, as a clip of its own (decoded by seeking)."""
        return ClipSpan(self, start, end)


class ClipSpan:
    """A time span of an opened `Clip` that reads as a clip of its own: `info` (its duration and frames),
    `frames_at` (times from the span's start), `data` and `origin_seconds` (for the sound decoder).
    The parent clip stays open and owned by its opener; several spans share it."""

    def __init__(self, clip: "Clip | ClipSpan", start: float, end: float):
        if not 0 <= start < end <= clip.info.duration + 1e-6:
            raise ValueError(f"span {start:g}-{end:g}s is not inside the clip's {clip.info.duration:.3f}s")
        self._clip, self.start, self.end = clip, start, end
        whole = clip.info
        duration = end - start
        self.info = replace(whole, duration=duration, frames=max(1, round(whole.frames * duration / whole.duration)))

    @property
    def data(self) -> bytes | MediaRef:
        return self._clip.data

    @property
    def origin_seconds(self) -> float:
        return self._clip.origin_seconds + self.start

    @property
    def stats(self) -> dict:
        return self._clip.stats

    def frames_at(self, times: list[float], size: tuple[int, int] | None = None) -> np.ndarray:
        return self._clip.frames_at([self.start + t for t in times], size)

    def span(self, start: float, end: float) -> "ClipSpan":
        return ClipSpan(self._clip, self.start + start, self.start + end)


def probe(video: bytes) -> VideoInfo:
    """Frame rate, frame count, duration, displayed size, rotation and sample aspect ratio of a clip.

    Decodes the first frame too, so a file that opens but cannot be decoded fails here.
    Raises SampleError("corrupt_video" | "no_video_stream" | "empty_video").
    """
    with Clip(video) as clip:
        return clip.info


def decode_at(
    video: bytes,
    times: list[float],
    info: VideoInfo | None = None,
    stats: dict | None = None,
    size: tuple[int, int] | None = None,
) -> np.ndarray:
    """(F, H, W, 3) uint8 RGB: the frame shown at each time (seconds from the clip's start).

    Opens the clip itself (`info`, from an earlier probe, is accepted for callers that have it and
    must describe the same clip). Seeks to the first needed time and decodes forward only as far
    as the last one. `size` (height, width) scales the frames while converting them. `stats`, if
    given, receives counts {"packets", "frames", "seeks"} of the whole call, for tests and benchmarks.
    """
    with Clip(video) as clip:
        if info is not None and (info.height, info.width, info.rotation) != (
            clip.info.height,
            clip.info.width,
            clip.info.rotation,
        ):
            raise ValueError(f"info describes another clip: {info} vs {clip.info}")
        out = clip.frames_at(times, size)
        if stats is not None:
            stats.update(clip.stats)
    return out
