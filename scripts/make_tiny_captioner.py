"""Build the tiny captioner (a Llava at a tiny size, random weights from a seed; vt.precompute.captioner_preset) for
`caption_model`, offline, in a few seconds.

    python scripts/make_tiny_captioner.py runs/models/captioner-tiny
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally


def main(argv: list[str] | None = None) -> None:
    from vt.precompute.captioner_preset import make_tiny_captioner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="weights are identical for a seed")
    parser.add_argument("out", type=Path, help="output folder")
    args = parser.parse_args(argv)
    print(make_tiny_captioner(args.out, args.seed))


if __name__ == "__main__":
    main()
