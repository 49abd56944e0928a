"""The broadcast order (train/parallel/order.py) on its own, two real gloo processes on a local window:
rank 1 gets rank 0's records without ever listing the window, hears "not yet" for a look ahead past the
commits, hears rank 0's heartbeats while rank 0 waits for a shard, and stops with rank 0's WindowTimeout
when the shard never comes.

Run as a script, this file is one rank (tests/helpers/forkserver.py starts it with torchrun's environment).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHARDS = 2  # committed before the world starts; the third never comes


def rank_main(window_uri: str, out: str) -> None:
    """One rank: walk the order through OrderFromRankZero past its committed shards; write what happened."""
    from vt.shared.config import ParallelConfig
    from vt.shared.window import WindowTimeout, open_reader
    from vt.shared.window.reader import NotYet
    from vt.train.parallel.order import OrderFromRankZero
    from vt.train.parallel.world import setup_world, shutdown_world

    world = setup_world(ParallelConfig(dp_replicate=2, dp_shard=1), "cpu")
    window = open_reader(window_uri, poll_seconds=0.02, timeout_seconds=0.5)
    lists = []
    find = window.storage.backend.find
    window.storage.backend.find = lambda base: (lists.append(base), find(base))[1]
    heard = []
    broadcast = world.broadcast_object
    world.broadcast_object = lambda value, src=0: (lambda got: (heard.append(got[0]), got)[1])(broadcast(value, src))
    order = OrderFromRankZero(window, world)
    result = {"rank": world.rank}
    try:
        result["records"] = [[position, order(position).data] for position in range(SHARDS)]
        result["again"] = [[1, order(1).data]]  # a resume's re-read
        try:
            order(SHARDS, block=False)  # a read-ahead's look: every rank hears "not yet"
        except NotYet:
            result["not_yet"] = True
        try:
            order(SHARDS)
        except WindowTimeout as err:
            result["error"] = str(err)
    finally:
        result.update(lists=len(lists), waits=heard.count("wait"))
        Path(f"{out}.{world.rank}").write_text(json.dumps(result))
        shutdown_world()


def test_rank_one_receives_the_order_and_rank_zeros_timeout(tmp_path):
    import torch

    from vt.shared.shards import encode_shard
    from vt.shared.window import open_writer

    from helpers.forkserver import launch_ranks

    window = open_writer(str(tmp_path / "window"), size="keep")
    window.register_producer(0, 1)
    for seq in range(SHARDS):
        data = encode_shard({"latents": torch.full((1, 4, 2, 2), float(seq))}, [f"k{seq}"], {"bucket": "9x64x64"})
        window.commit(0, seq, 0, data, "9x64x64", [f"k{seq}"], "fp")
    log = tmp_path / "ranks.log"
    group = launch_ranks(__file__, 2, str(tmp_path / "window"), str(tmp_path / "out"), log=log)
    assert group.wait(timeout=120) == 0, log.read_text()[-4000:]
    first, second = (json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2))
    assert first["records"] == second["records"] and [p for p, _ in first["records"]] == [0, 1]
    assert first["again"] == second["again"] == [first["records"][1]]
    assert first.get("not_yet") and second.get("not_yet"), "a look ahead past the commits is 'not yet' on every rank"
    assert first["lists"] > 0 and second["lists"] == 0, (first, second)
    assert second["waits"] > 1 and second["waits"] == first["waits"], "rank 1 heard rank 0 wait, poll by poll"
    assert "waited" in first["error"] and second["error"].startswith("rank 0, the reader of the window's order")
    assert first["error"] in second["error"]


if __name__ == "__main__":
    rank_main(*sys.argv[1:3])
