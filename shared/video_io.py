"""Write and read small RGB videos (validation samples, previews, test fixtures) with PyAV.

h264 in yuv420p is what every browser and player opens, and yuv420p needs even width and height,
so odd sizes are padded by repeating the last row/column rather than rejected. The file is written
under a temporary name and renamed, so a viewer polling the folder never opens half a video.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from vt.shared.errors import UserError


def load_image(path: str | Path) -> np.ndarray:
    """An image file -> (H, W, 3) uint8 RGB (PyAV reads PNG/JPEG/WebP as one-frame videos)."""
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        return frame.to_ndarray(format="rgb24")


@dataclass(frozen=True)
class Sound:
    """A sound track: (channels, samples) float32 in [-1, 1] at `sample_rate` Hz."""

    waveform: np.ndarray
    sample_rate: int

    def __post_init__(self):
        if self.waveform.ndim != 2 or self.waveform.shape[0] not in (1, 2):
            raise ValueError(f"a sound track is (channels 1 or 2, samples), got shape {self.waveform.shape}")
        if not self.sample_rate > 0:
            raise ValueError(f"sample_rate must be > 0, got {self.sample_rate}")


def write_video(frames: np.ndarray, path: Path, fps: float = 8.0, sound: Sound | None = None) -> Path:
    """Encode (F, H, W, 3) uint8 RGB frames as an h264 mp4 at `path`, with `sound` as an AAC track beside
    them; returns `path`."""
    frames = _check_frames(frames)
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    frames = _pad_to_even(frames)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18", "preset": "medium"}
            audio = _sound_stream(container, sound) if sound is not None else None  # every stream before muxing
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():  # flush the encoder's delayed frames
                container.mux(packet)
            if audio is not None:
                _mux_sound(container, audio, sound)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _sound_stream(container, sound: Sound):
    return container.add_stream("aac", rate=sound.sample_rate, layout="stereo" if len(sound.waveform) == 2 else "mono")


def _mux_sound(container, stream, sound: Sound) -> None:
    """`sound` encoded into the AAC `stream` of `container` (PyAV cuts it to the encoder's frame size)."""
    samples = np.ascontiguousarray(np.clip(sound.waveform, -1.0, 1.0).astype(np.float32))
    frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=stream.layout.name)
    frame.sample_rate = sound.sample_rate
    frame.pts = 0
    for packet in stream.encode(frame):
        container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)


def read_sound(path: Path) -> Sound | None:
    """The first audio stream of a media file as a Sound (None without one)."""
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        planar = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=stream.rate)
        chunks = [out.to_ndarray() for frame in container.decode(stream) for out in planar.resample(frame)]
        chunks += [out.to_ndarray() for out in planar.resample(None)]
        rate = stream.rate
    waveform = np.concatenate(chunks, axis=1) if chunks else np.zeros((stream.channels, 0), np.float32)
    return Sound(waveform.astype(np.float32), rate)


def read_video(path: Path) -> np.ndarray:
    """Decode every frame of the first video stream as (F, H, W, 3) uint8 RGB."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no video at {path}")
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path} has no video stream")
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path} has a video stream but no frames could be decoded")
    return np.stack(frames)


def read_fitted(path: str | Path, bucket, fps: float) -> np.ndarray:
    """The first `bucket.frames` frames of the video at `path` sampled at `fps` (the frame shown at 0,
    1/fps, ...), scaled to cover the bucket and center-cropped: (F, H, W, 3) uint8, as stage 1 fits a clip
    (a validation control video; PIL's antialiased bicubic resize where stage 1 has FFmpeg's, and the
    stored picture, without rotation or pixel-aspect metadata). ValueError if the video ends first."""
    from PIL import Image

    from vt.shared.buckets import crop_box, resize_for_crop

    times = [k / fps for k in range(bucket.frames)]
    picked: list = []
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path} has no video stream")
        stream = container.streams.video[0]
        origin = stream.start_time or 0
        shown = None
        for frame in container.decode(stream):
            start = float((frame.pts - origin) * stream.time_base) if frame.pts is not None else None
            while (
                shown is not None
                and start is not None
                and len(picked) < len(times)
                and start > times[len(picked)] + 1e-6
            ):
                picked.append(shown)
            if len(picked) == len(times):
                break
            shown = frame
        if len(picked) < len(times) and shown is not None:  # the last frame is on screen to the stream's end
            end = float(stream.duration * stream.time_base) if stream.duration else None
            while len(picked) < len(times) and end is not None and times[len(picked)] < end - 1e-6:
                picked.append(shown)
    if len(picked) < len(times):
        raise UserError(
            f"{path} holds {len(picked)} frames at {fps:g} fps; bucket {bucket.name} needs "
            f"{bucket.frames} ({bucket.frames / fps:.3f}s): give a longer video"
        )
    out = np.empty((bucket.frames, bucket.height, bucket.width, 3), dtype=np.uint8)
    for index, frame in enumerate(picked):
        image = frame.to_image()
        height, width = resize_for_crop(image.height, image.width, bucket)
        top, left = crop_box(height, width, bucket)
        image = image.resize((width, height), Image.Resampling.BICUBIC, reducing_gap=None)
        out[index] = np.asarray(image.crop((left, top, left + bucket.width, top + bucket.height)))
    return out


def _check_frames(frames) -> np.ndarray:
    if not isinstance(frames, np.ndarray):
        raise TypeError(
            f"frames must be a numpy array (F, H, W, 3) uint8, got {type(frames).__name__}; "
            "for a torch tensor use tensor.cpu().numpy()"
        )
    if frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
        raise ValueError(f"frames must have shape (F, H, W, 3) with F, H, W >= 1, got {frames.shape}")
    if frames.dtype != np.uint8:
        raise UserError(
            f"frames must be uint8 in [0, 255], got {frames.dtype}; for floats in [0, 1] "
            "use (frames * 255).round().clip(0, 255).astype(np.uint8)"
        )
    return np.ascontiguousarray(frames)


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    """yuv420p halves chroma in both directions: pad an odd height/width by one edge row/column."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
