"""What the metrics read: a video's frames and sound, evenly sampled frames, and the reference clips.

A reference clip is read as stage 1 reads a clip for a bucket (`read_fitted`: frames at the run's fps from its start,
scaled to cover and center-cropped), at the size and length of the validation video it is compared with, so the
likeness and motion of a render and of a training clip are measured on frames alike. A reference is given as video
files or folders of them (searched recursively).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vt.shared.buckets import Bucket
from vt.shared.errors import UserError
from vt.shared.video_io import Sound, read_fitted, read_sound, read_video

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi")


@dataclass(frozen=True)
class Clip:
    frames: np.ndarray  # (F, H, W, 3) uint8 RGB
    fps: float
    sound: Sound | None = None

    @property
    def bucket(self) -> Bucket:
        frames, height, width = self.frames.shape[:3]
        return Bucket(frames, height, width)


def read_clip(path: Path, fps: float) -> Clip:
    """A validation video: every frame, its sound track (None without one); `fps`: the rate it was written at."""
    return Clip(read_video(path), fps, read_sound(path))


def sample(count: int, wanted: int) -> np.ndarray:
    """`wanted` indices spread evenly over `count` frames, first and last included (all of them when fewer)."""
    return np.unique(np.linspace(0, count - 1, min(wanted, count)).round().astype(int))


def video_files(paths: list[str], key: str) -> list[Path]:
    """The video files `paths` name (a folder: the videos under it), sorted; UserError naming `key` if none."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.suffix.lower() in VIDEO_SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            raise UserError(f"{key}: {text!r} is neither a video file nor a folder: give clips this machine can read")
    if paths and not found:
        raise UserError(f"{key} = {paths}: no video files there ({', '.join(VIDEO_SUFFIXES)})")
    return found


def read_references(paths: list[Path], like: Clip, key: str) -> list[np.ndarray]:
    """Each reference clip's frames fitted to `like`'s length, size and fps."""
    clips = []
    for path in paths:
        try:
            clips.append(read_fitted(path, like.bucket, like.fps))
        except (OSError, ValueError) as err:  # UserError (too short) is a ValueError
            raise UserError(f"{key}: cannot use {path} as a reference for {like.bucket.name} videos ({err})") from err
    return clips
