"""Write and read small RGB videos (validation samples, previews, test fixtures) with PyAV.

h264 in yuv420p is what every browser and player opens, and yuv420p needs even width and height,
so odd sizes are padded by repeating the last row/column rather than rejected. The file is written
under a temporary name and renamed, so a viewer polling the folder never opens half a video.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np


def load_image(path: str | Path) -> np.ndarray:
    """An image file -> (H, W, 3) uint8 RGB (PyAV reads PNG/JPEG/WebP as one-frame videos)."""
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        return frame.to_ndarray(format="rgb24")


def write_video(frames: np.ndarray, path: Path, fps: float = 8.0) -> Path:
    """Encode (F, H, W, 3) uint8 RGB frames as an h264 mp4 at `path`; returns `path`."""
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
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():  # flush the encoder's delayed frames
                container.mux(packet)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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


def _check_frames(frames) -> np.ndarray:
    if not isinstance(frames, np.ndarray):
        raise TypeError(f"frames must be a numpy array (F, H, W, 3) uint8, got {type(frames).__name__}; "
                        "for a torch tensor use tensor.cpu().numpy()")
    if frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
        raise ValueError(f"frames must have shape (F, H, W, 3) with F, H, W >= 1, got {frames.shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 in [0, 255], got {frames.dtype}; for floats in [0, 1] "
                         "use (frames * 255).round().clip(0, 255).astype(np.uint8)")
    return np.ascontiguousarray(frames)


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    """yuv420p halves chroma in both directions: pad an odd height/width by one edge row/column."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
