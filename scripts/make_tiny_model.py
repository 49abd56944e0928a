"""Build a tiny model preset (random weights from a seed) in diffusers layout.

The folder loads with the family pipeline's `from_pretrained` (LTXPipeline, WanPipeline), the
same code path a real checkpoint takes, so tests and the demo exercise the real loading code.
Building takes about a second on CPU and needs no network.

    python scripts/make_tiny_model.py --family ltx-video runs/models/ltx-video-tiny
    python scripts/make_tiny_model.py --family wan --seed 1 runs/models/wan-tiny
    python scripts/make_tiny_model.py --family wan --task i2v runs/models/wan-i2v-tiny
    python scripts/make_tiny_model.py --family wan --task flf2v runs/models/wan-flf2v-tiny
    python scripts/make_tiny_model.py --family ltx-2 --task i2v runs/models/ltx2-i2v-tiny
    python scripts/make_tiny_model.py --family wan2.2 --task i2v runs/models/wan22-i2v-tiny
    python scripts/make_tiny_model.py --family wan2.2-ti2v runs/models/wan22-ti2v-tiny
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally


def make_tiny_model(family: str, out: Path, seed: int = 0, task: str = "t2v") -> Path:
    """Write the tiny preset of `family` for `task` into `out` (created if missing) and return `out`."""
    from vt.shared.models import get_spec_class

    spec_class = get_spec_class(family)
    if task not in spec_class.tasks:
        raise ValueError(f"family {family!r} has no task {task!r}; tasks: {list(spec_class.tasks)}")
    return spec_class.make_tiny(Path(out), seed=seed, task=task)


def main(argv: list[str] | None = None) -> None:
    from vt.shared.log import apply_level
    from vt.shared.models import FAMILIES

    apply_level("info")  # vt's logging set-up; the libraries' bars ("Writing model shards") and notices hidden

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=FAMILIES, help="model family")
    parser.add_argument("--seed", type=int, default=0, help="weights are identical for a seed")
    parser.add_argument(
        "--task",
        default="t2v",
        choices=("t2v", "i2v", "flf2v"),
        help="the preset for this task (its pipeline's layout)",
    )
    parser.add_argument("out", type=Path, help="output folder (diffusers layout)")
    args = parser.parse_args(argv)
    print(make_tiny_model(**vars(args)))  # family, out, seed, task


if __name__ == "__main__":
    main()
