"""A clip's sound over the time span of its sampled frames (PyAV), for families that train audio (model.audio).

The frames of a sample are shown from `start` to `start + frames / fps` (seconds from the video stream's
time 0, sample_frames.py); its sound is the same span of the container's timeline, so picture and sound
stay in sync whatever the streams' start times (a video stream starting at 0.1 s, AAC priming). The audio
stream is decoded from just before the span (a seek for spans past the first seconds) to its end, and
converted by FFmpeg's resampler (libswresample) to the family's rate as planar float; then the span is cut
by sample position, counted from the first decoded frame's timestamp. A track that starts late or ends
early is padded with silence there, as the reference trainers pad. Channels: a mono track feeds both
channels of a stereo family unchanged (as the reference trainers duplicate it; FFmpeg's own upmix would
lower it by 3 dB), more channels are mixed down by FFmpeg.

A clip without an audio stream (or with one that holds no decodable frame) is `missing_audio` under
data.missing_audio = "skip", silence under "silence"; a track FFmpeg cannot decode is `corrupt_audio`.
The container is opened a second time, beside the video decoder's (an in-memory file: cheap), so the
video's seek position is never disturbed; nothing here runs unless model.audio asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np
import torch

from ..media_ref import MediaRef, open_media
from .errors import SampleError

_SEEK_AFTER = 2.0  # seconds: spans starting later seek; earlier ones decode from the start (cheaper than a seek)
_SEEK_MARGIN = 0.5  # seconds before the span the seek aims at: the frame holding the span's start comes before it


@dataclass(frozen=True)
class SoundRequest:
    """What stage 1 asks of each clip's sound (model.audio): the family's rate and channels
    (ModelSpec.sound.format()) and what a clip without a sound track gets (data.missing_audio)."""

    sample_rate: int
    channels: int
    missing: str = "skip"  # "skip": rejected as missing_audio; "silence": zeros

    def __post_init__(self):
        if self.sample_rate < 1 or self.channels not in (1, 2) or self.missing not in ("skip", "silence"):
            raise ValueError(
                f"a sound request needs a rate >= 1, 1 or 2 channels and missing 'skip' or 'silence', got {self}"
            )

    def samples(self, seconds: float) -> int:
        """Samples in `seconds` of sound (SoundStream.samples' rounding)."""
        return round(seconds * self.sample_rate)


def decode_sound(video: bytes | MediaRef, begin: float, seconds: float, request: SoundRequest) -> torch.Tensor:
    """(request.channels, request.samples(seconds)) float32 in [-1, 1]: the first audio stream from `begin`
    (seconds on the container's timeline) for `seconds`, resampled to the request's rate and channels.
    SampleError("missing_audio") for a clip without sound under "skip", ("corrupt_audio") for a broken track."""
    count = request.samples(seconds)
    seek = begin > _SEEK_AFTER
    has_track, decoded = _open_and_decode(video, begin, seconds, request, seek)
    if seek and decoded is not None and decoded[1] > begin:  # the seek landed past the span (an index quirk)
        has_track, decoded = _open_and_decode(video, begin, seconds, request, seek=False)
    if decoded is None:
        if request.missing == "skip":
            what = "an audio stream without a decodable frame" if has_track else "no audio stream"
            raise SampleError(
                "missing_audio",
                f"the clip has {what}; the family trains sound with the picture "
                '(set data.missing_audio = "silence" to train it on silence)',
            )
        return torch.zeros(request.channels, count)
    waveform, first = decoded
    offset = round((begin - first) * request.sample_rate)  # where the span starts in the decoded samples
    if offset < 0:  # the track starts after the span does: silence before it
        waveform = np.pad(waveform, ((0, 0), (-offset, 0)))
        offset = 0
    piece = waveform[:, offset : offset + count]
    if piece.shape[1] < count:  # the track ends before the span does: silence after it
        piece = np.pad(piece, ((0, 0), (0, count - piece.shape[1])))
    if piece.shape[0] < request.channels:  # mono for a stereo family: the same sound in both channels
        piece = np.repeat(piece, request.channels, axis=0)
    return torch.from_numpy(np.clip(piece, -1.0, 1.0).astype(np.float32, copy=False))


def _open_and_decode(
    video: bytes | MediaRef, begin: float, seconds: float, request: SoundRequest, seek: bool
) -> tuple[bool, tuple[np.ndarray, float] | None]:
    """(whether the file has an audio stream, `_decode_span`'s result or None); FFmpeg's failures are
    `corrupt_audio`."""
    try:
        with av.open(open_media(video), mode="r") as container:
            if not container.streams.audio:
                return False, None
            return True, _decode_span(container, container.streams.audio[0], begin, begin + seconds, request, seek)
    except (av.FFmpegError, ValueError, OSError) as err:  # ValueError: PyAV's resampler on a frame it cannot take
        raise SampleError("corrupt_audio", f"the sound track cannot be decoded: {err}") from None


def _decode_span(
    container, stream, begin: float, end: float, request: SoundRequest, seek: bool
) -> tuple[np.ndarray, float] | None:
    """(waveform (channels, n) at the request's rate, time in seconds of its first sample) covering [begin, end)
    as far as the track reaches, decoded from a seek to just before `begin` or from the start; None when the
    stream yields no frame."""
    stream.codec_context.thread_count = 1  # one clip per worker process (see decode.py)
    base = stream.time_base
    if seek:
        container.seek(int((begin - _SEEK_MARGIN) / base), stream=stream, backward=True)
    source_channels = stream.codec_context.channels or 0
    layout = "mono" if request.channels == 1 or source_channels == 1 else "stereo"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=request.sample_rate)
    chunks: list[np.ndarray] = []
    first = None
    for frame in container.decode(stream):
        at = float(frame.pts * base) if frame.pts is not None else None
        if first is None:
            first = at if at is not None else float((stream.start_time or 0) * base)
        elif at is not None and at >= end:
            break  # every frame the span needs is decoded
        chunks += [out.to_ndarray() for out in resampler.resample(frame)]
    if first is None:
        return None
    chunks += [out.to_ndarray() for out in resampler.resample(None)]  # what the resampler still holds
    channels = 1 if layout == "mono" else 2
    waveform = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), np.float32)
    return waveform, first
