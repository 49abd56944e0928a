"""Each data-parallel rank reads 1/D of the data (issue 17): real gloo processes at 2 and 8 ranks, every
storage request counted per rank by tests/helpers/counting_worker.py's `counted://` backend.

The window: the kept LTX-Video window's samples re-encoded (scripts/scale_window.py) as 16 samples in 4
shards of 4, one bucket; at global batch 8 the run is 2 optimizer steps whose batches are full and divide
by 2 and by 8, so no rank holds a larger slice or reads a stand-in row. The data ends at the last step,
so the read-ahead (on, at its default budget) reads nothing a step does not train.

Asserted per rank: the bytes it read of the shards, less their headers and the caption tables' small
tensors, are at most 1/D of the run's global batches' bytes (each sample's rows of every per-sample tensor
plus its caption's stored text rows, from the shards themselves), and they are exactly its slice's rows
and captions; only rank 0, the order's reader, lists the window. docs/scale.md quotes the printed numbers.
"""

from __future__ import annotations

import pytest
from scale_window import COUNTING_WORKER, rank_row, read_counts, regroup, run_bytes

from helpers.dist_runs import finish, torchrun

FAMILY = "ltx-video"
SAMPLES, PER_SHARD, BATCH = 16, 4, 8


@pytest.fixture(scope="module")
def even_window(kept_window, tmp_path_factory):
    """(window folder, RunBytes): 16 samples in 4 shards of 4, read in 2 global batches of 8."""
    window, _ = kept_window(FAMILY)
    folder = tmp_path_factory.mktemp("even-window") / "window"
    regroup(window, folder, SAMPLES, PER_SHARD)
    return folder, run_bytes(folder, BATCH)


@pytest.mark.parametrize("dp", [2, 8], ids=["ddp-2", "ddp-8"])
@pytest.mark.xdist_group(f"parity-{FAMILY}")
def test_each_rank_reads_its_share_of_the_bytes(tmp_path, run_config, even_window, dp):
    window, run = even_window
    assert [len(b) for b in run.batches] == [BATCH, BATCH] and BATCH % dp == 0
    config = run_config(tmp_path, FAMILY, "even", batch_size=BATCH)
    log, counts = tmp_path / "run.log", tmp_path / "counts"
    finish(
        torchrun(
            config,
            dp,
            f"window.uri=counted://{window}",
            f"parallel.dp_replicate={dp}",
            "parallel.dp_shard=1",
            log=log,
            script=COUNTING_WORKER,
            env={"VT_STORAGE_COUNTS": str(counts)},
        ),
        log,
    )
    steps = len((tmp_path / "even" / "metrics.jsonl").read_text().splitlines())
    assert steps == len(run.batches)
    share = run.global_bytes / dp
    # The tolerance: a bucket's samples have rows of one size, but captions keep different numbers of text
    # rows, so a rank's B/D samples a step can hold up to B/D x (longest caption - mean caption) more than
    # 1/D of the batch (a caption two of its samples share it reads once, which only lowers its bytes).
    tolerance = run.caption_excess(BATCH // dp * len(run.batches))
    for rank, counted in enumerate(read_counts(counts, dp)):
        expected = run.rank_reads(rank, dp)
        row = rank_row(counted, expected)
        print(
            f"{dp} ranks, rank {rank}: {steps} steps, data {row['data_bytes']} B in {row['data_requests']} "
            f"requests over {row['shards']} shards (headers {row['header_bytes']} B in {row['header_requests']}, "
            f"caption tables {row['table_bytes']} B), rows and captions {row['rows_bytes']} B; 1/D of the run's "
            f"{run.global_bytes} B = {share:.0f} B (+{tolerance} B for its captions' lengths); lists {row['lists']}, "
            f"all reads {counted.get('reads', 0)} ({counted.get('bytes_read', 0)} B)"
        )
        assert row["data_bytes"] == expected["data"], (rank, row, expected)  # its rows, nothing else
        assert row["header_bytes"] == expected["headers"] and row["header_requests"] == expected["shards"]
        assert row["rows_bytes"] <= share + tolerance, (rank, row, share, tolerance)
        if rank:
            assert row["lists"] == 0, f"rank {rank} listed the window: {counted}"
