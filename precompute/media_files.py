"""A folder of media files with caption sidecars as raw input, besides webdataset tars.

The layout the peers take: `clips/a.mp4` + `clips/a.txt` (or `a.json` {"caption": ...}), stills
`clips/b.jpg` + `clips/b.txt`, in any subfolders, locally or under s3://. A sample's key is its path
below the listed folder up to the first dot of the file name (webdataset's rule, so a folder packed
into tars by `vt-precompute pack` keeps its keys). Each sample is one unit of work: listing gives one
URL per key (its video, else its image), and `read_media_sample` reads that file and its sidecar into
the same {extension: bytes} members a tar sample has, so everything downstream is shared. A control
video (`clips/a.control.mp4` beside `clips/a.mp4`: extension `control.mp4`, never a sample of its own)
is read too when asked for, under the clip's extension or .mp4.
"""

from __future__ import annotations

from collections.abc import Iterable

import fsspec

SIDECARS = ("txt", "json")


def split_key(path: str) -> tuple[str, str]:
    """'dir/clip-001.mp4' -> ('dir/clip-001', 'mp4'); the key ends at the first dot of the file name."""
    folder, _, base = path.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext.lower() if dot else "")


def pick_media(paths: Iterable[str], extensions: tuple[str, ...]) -> list[str]:
    """One media path per key among `paths`: the first of `extensions` (videos before images) the key has."""
    rank = {ext: i for i, ext in enumerate(extensions)}
    best: dict[str, tuple[int, str]] = {}
    for path in paths:
        key, ext = split_key(path)
        if ext in rank and (key not in best or rank[ext] < best[key][0]):
            best[key] = (rank[ext], path)
    return sorted(path for _, path in best.values())


def read_media_sample(url: str, control: str | None = None) -> dict[str, bytes]:
    """{extension: bytes} of the media file at `url` and its caption sidecars that exist; with `control`
    (a member name, e.g. "control") also `<key>.control.<ext>`, with the file's own extension or mp4."""
    fs, path = fsspec.core.url_to_fs(url)
    key, ext = split_key(path)
    files = {ext: fs.cat_file(path)}
    controls = [f"{control}.{e}" for e in dict.fromkeys((ext, "mp4"))] if control else []
    for sidecar in (*SIDECARS, *controls):
        try:
            files[sidecar] = fs.cat_file(f"{key}.{sidecar}")
        except FileNotFoundError:
            continue
    return files
