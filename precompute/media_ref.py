"""A clip that stays in its file: a media URI (any fsspec path) and a time span, decoded by seeking.

Samples from a tar or a folder of clips carry their file's bytes; a sample from a clip manifest
(manifests.py) carries a `MediaRef` instead, so an hour-long source video cut into clips by timestamps
is never downloaded or read whole: PyAV reads the file through fsspec's seekable file object (ranged
reads on s3://), seeks to the keyframe before the span and decodes only as far as the frames it needs.
`open_media` opens either kind for PyAV.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import BinaryIO

import fsspec


@dataclass(frozen=True)
class MediaRef:
    """`uri`'s media from `start` to `end` seconds on its video stream's timeline (None: to the file's end)."""

    uri: str
    start: float = 0.0
    end: float | None = None

    def __post_init__(self):
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ValueError(f"a clip's span needs 0 <= start < end, got start={self.start} end={self.end}")


def open_media(source: bytes | MediaRef) -> BinaryIO:
    """A seekable binary file of `source`: its bytes, or its URI opened through fsspec (read as PyAV asks).
    FileNotFoundError when a referenced file is not there."""
    if isinstance(source, MediaRef):
        return fsspec.open(source.uri, "rb").open()
    return io.BytesIO(source)


def describe(source: bytes | MediaRef) -> str:
    if isinstance(source, MediaRef):
        end = "the end" if source.end is None else f"{source.end:g}s"
        return f"{source.uri} from {source.start:g}s to {end}"
    return f"{len(source)} bytes"
