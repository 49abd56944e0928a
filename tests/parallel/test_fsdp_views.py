"""FSDP2's outputs are not views: torch warns "FSDP2-wrapped module ... returned a view tensor" when a
sharded module returns one (train/parallel/fsdp.py says which and why); here that warning is an error."""

from __future__ import annotations

import re

from helpers import HELPERS
from helpers.dist_runs import finish
from helpers.forkserver import launch_ranks

WORKER = HELPERS / "view_worker.py"


def test_fsdp2_sharded_modules_return_no_views_at_two_ranks(tmp_path):
    """Two ranks shard Wan (its root returning a BaseOutput) and CogVideoX (blocks and attention returning
    tuples of slices) and train a step each with warnings as errors: a view output fails the rank."""
    log = tmp_path / "ranks.log"
    finish(launch_ranks(str(WORKER), 2, log=log), log)
    text = log.read_text()
    for rank in (0, 1):
        for family in ("wan", "cogvideox"):
            found = re.search(rf"rank {rank} {family}: ok, (\d+) of (\d+) parameters with gradients", text)
            assert found and found[1] == found[2], text[-3000:]
