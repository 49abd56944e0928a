"""A folder of clips and images with caption sidecars as raw input, and `pack` into tars: local and S3.

Real media throughout: mp4 pieces and .jpg / .png / .webp stills cut from the sample clips.
"""

from __future__ import annotations

import json
import shutil
import tarfile

import fsspec
import pytest

from vt.precompute.pack import pack_folder, parse_size
from vt.precompute.sources import iter_raw_samples, list_raw_shards, shard_names

from helpers.cli_runs import BIN


def samples_of(uri: str) -> dict[str, tuple[bytes, str, bool]]:
    """sample key (without the shard name) -> (media bytes, caption, still) over everything at `uri`."""
    units = list_raw_shards(uri)
    names = shard_names(units)
    out = {}
    for url in units:
        for raw in iter_raw_samples(url, names[url]):
            assert raw.error is None, (raw.key, raw.error)
            out[raw.key] = (raw.video, raw.caption, raw.still)
    return out


@pytest.fixture
def folder(media_folder, tmp_path):
    """A copy of the media folder plus the awkward cases: a subfolder, a .json caption, a key with
    both a video and an image (its video is the sample), and a caption with no media (ignored)."""
    root = tmp_path / "clips"
    shutil.copytree(media_folder, root)
    (root / "sub").mkdir()
    shutil.move(root / "bikes-still-000.png", root / "sub" / "bikes-still-000.png")
    (root / "bikes-still-000.txt").unlink()
    (root / "sub" / "bikes-still-000.json").write_text(json.dumps({"caption": "bikes, from json"}))
    shutil.copy(root / "bigbuckbunny-still-000.jpg", root / "bikes-000.jpg")
    (root / "orphan.txt").write_text("no media for this caption")
    return root


def test_a_folder_lists_one_sample_per_key_with_its_caption(folder):
    samples = samples_of(str(folder))

    media = {p.name.split(".")[0] for p in folder.rglob("*") if p.suffix in (".mp4", ".jpg", ".png", ".webp")}
    assert set(samples) == {m if m != "bikes-still-000" else "sub/bikes-still-000" for m in media}
    assert samples["sub/bikes-still-000"][1:] == ("bikes, from json", True)
    video, caption, still = samples["bikes-000"]
    assert video == (folder / "bikes-000.mp4").read_bytes() and not still  # the video wins over the image
    assert caption == (folder / "bikes-000.txt").read_text()
    stills = {k for k, (_, _, s) in samples.items() if s}
    assert {p.suffix for p in folder.rglob("*-still-*") if p.suffix != ".txt" and p.suffix != ".json"} == {
        ".jpg",
        ".png",
        ".webp",
    }
    assert len(stills) == 4 and all("still" in k for k in stills)


def test_pack_writes_tars_of_the_size_that_read_as_the_folder(folder, tmp_path):
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    tars = pack_folder(str(folder), str(tmp_path / "packed"), shard_bytes=total // 3)

    assert len(tars) >= 3 and all(t.endswith(".tar") for t in tars)
    assert not list((tmp_path / "packed").glob("*.part"))
    with tarfile.open(tars[0]) as tar:  # webdataset layout: <key>.<ext> members, consecutive per sample
        names = tar.getnames()
    assert names[0].rsplit(".", 1)[0] == names[1].rsplit(".", 1)[0]
    assert samples_of(str(tmp_path / "packed")) == samples_of(str(folder))
    assert parse_size("1GiB") == 2**30 and parse_size("512MB") == 512 * 10**6
    with pytest.raises(ValueError, match="must look like"):
        parse_size("lots")


def test_folder_input_and_pack_on_s3(folder, s3_bucket, tmp_path):
    import subprocess

    fs = fsspec.filesystem("s3")
    fs.put(str(folder), f"{s3_bucket}/clips", recursive=True)
    third = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) // 3
    assert samples_of(f"{s3_bucket}/clips") == samples_of(str(folder))

    result = subprocess.run(
        [str(BIN / "vt-precompute"), "pack", f"{s3_bucket}/clips", f"{s3_bucket}/packed", "--shard-size", str(third)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.split()
    assert len(printed) >= 2 and printed == sorted(list_raw_shards(f"{s3_bucket}/packed"))
    assert samples_of(f"{s3_bucket}/packed") == samples_of(str(folder))
