"""Build the tiny metric models ([metrics]: CLIP, SigLIP, DINOv2, CLAP at tiny sizes, random weights from a seed) in
the layout of their hub checkpoints, offline, in a few seconds (vt.train.video_metrics.presets).

    python scripts/make_tiny_metric_models.py runs/models/metrics-tiny
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally


def main(argv: list[str] | None = None) -> None:
    from vt.shared.log import apply_level
    from vt.train.video_metrics.presets import make_tiny_metric_models

    apply_level("info")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="weights are identical for a seed")
    parser.add_argument("out", type=Path, help="output folder: one folder per model inside")
    args = parser.parse_args(argv)
    for name, folder in make_tiny_metric_models(args.out, args.seed).items():
        print(f"{name}: {folder}")


if __name__ == "__main__":
    main()
