"""One reader of the window's order (train/parallel/order.py): in a real multi-process run only rank 0
lists the window and reads its commit records and registrations; the other ranks read only the data the
broadcast records name, and the run trains what one process trains.

The ranks run vt-train through tests/helpers/counting_worker.py, which counts every storage request per rank (the
window is reached as counted://, a local folder whose backend counts). The run is the parity suite's
LTX-Video run (13 samples in batches of 4: 4 optimizer steps, 7 shards of 2), compared with its one-process
reference like a parity row; docs/scale.md quotes the numbers printed here.
"""

from __future__ import annotations

import json

import pytest

from helpers import HELPERS
from helpers.dist_runs import assert_same_training, finish, torchrun

FAMILY = "ltx-video"
ORDER_FOLDERS = ("commits", "producers")  # what resolving the order reads (besides listing commits/)


def counted_run(tmp_path, run_config, kept_window, nproc: int, *overrides: str) -> list[dict]:
    """Run `nproc` ranks on the counted window; returns each rank's request counts, in rank order."""
    window, _ = kept_window(FAMILY)
    name = f"counted-{nproc}"
    config = run_config(tmp_path, FAMILY, name)
    log = tmp_path / "run.log"
    counts = tmp_path / "counts"
    finish(
        torchrun(
            config,
            nproc,
            f"window.uri=counted://{window}",
            *overrides,
            log=log,
            script=HELPERS / "counting_worker.py",
            env={"VT_STORAGE_COUNTS": str(counts)},
        ),
        log,
    )
    per_rank = [json.loads((tmp_path / f"counts.{rank}").read_text()) for rank in range(nproc)]
    steps = max(json.loads(line)["step"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines())
    for rank, c in enumerate(per_rank):  # the numbers docs/scale.md quotes
        print(
            f"{nproc} ranks, rank {rank}: {steps} steps, lists {c.get('lists', 0)}, reads {c.get('reads', 0)} "
            f"({c.get('bytes_read', 0)} bytes), of them order reads "
            f"{sum(c.get(f'reads:{f}', 0) for f in ORDER_FOLDERS)}, data reads {c.get('reads:data', 0)}, "
            f"exists {c.get('exists', 0)}, writes {c.get('writes', 0)}"
        )
    return per_rank


def check_one_reader(per_rank: list[dict]) -> None:
    """Rank 0 resolves the order (lists, reads records); every other rank lists nothing and reads only data."""
    first, others = per_rank[0], per_rank[1:]
    assert first.get("lists", 0) > 0 and sum(first.get(f"reads:{f}", 0) for f in ORDER_FOLDERS) > 0, (
        f"rank 0 did not resolve the order: {first}"
    )
    for rank, counts in enumerate(others, start=1):
        assert counts.get("lists", 0) == 0, f"rank {rank} listed the window: {counts}"
        order_reads = {f: counts[f"reads:{f}"] for f in ORDER_FOLDERS if counts.get(f"reads:{f}")}
        assert not order_reads, f"rank {rank} read the order's records itself: {order_reads}"
        assert counts.get("reads:data", 0) > 0, (rank, counts)  # its rows of the shards


@pytest.mark.parametrize(
    "nproc, overrides",
    [
        pytest.param(2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], id="ddp-2"),
        pytest.param(8, ["parallel.dp_replicate=8", "parallel.dp_shard=1"], id="ddp-8"),
    ],
)
@pytest.mark.xdist_group(f"parity-{FAMILY}")
def test_only_rank_zero_reads_the_order(tmp_path, run_config, kept_window, reference, nproc, overrides):
    per_rank = counted_run(tmp_path, run_config, kept_window, nproc, *overrides)
    check_one_reader(per_rank)
    assert_same_training(tmp_path / f"counted-{nproc}", reference(FAMILY))
