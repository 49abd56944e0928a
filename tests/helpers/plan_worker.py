"""`vt-train plan`'s make_plan in a process where no test ran before: `plan_worker.py CONFIG.toml OUT.json DEVICE...`.

Forked from the warm interpreter of tests/helpers/forkserver.py (it imported the libraries and ran nothing), it plans
CONFIG for each DEVICE as the trainer's start-up does (stage 1 left out, only the step the config runs traced) and
writes each plan's activations and validation bytes to OUT as JSON. Imports nothing from tests/.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path


def main(config_path: str, out_path: str, *devices: str) -> None:
    from vt.shared.config import Config, build
    from vt.train.plan import make_plan

    config = build(Config, tomllib.loads(Path(config_path).read_text()), "")
    plans = [make_plan(config, 1, device, stage1=False, lean=True) for device in devices]
    Path(out_path).write_text(
        json.dumps([{"activations": p.activations, "validation": p.rank.validation} for p in plans])
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
