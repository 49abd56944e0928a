"""Two torchrun 'nodes' on one machine (c10d rendezvous on 127.0.0.1, one process each) train the same
model as the single-node runs: the launch the README documents for real clusters."""

from __future__ import annotations

from helpers.dist_runs import assert_same_training, finish, free_port, torchrun


def test_two_nodes_match_the_single_node_run(tmp_path, run_config, reference):
    config = run_config(tmp_path, "ltx-video", "two-nodes")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        torchrun(
            config,
            1,
            "parallel.dp_replicate=2",
            "parallel.dp_shard=1",
            log=tmp_path / f"node{i}.log",
            nnodes=2,
            endpoint=endpoint,
        )
        for i in range(2)
    ]
    for i, node in enumerate(nodes):
        finish(node, tmp_path / f"node{i}.log")

    logs = "".join((tmp_path / f"node{i}.log").read_text() for i in range(2))
    assert "[rank0]" in logs and "[rank1]" in logs and "world 2 = dp_replicate 2" in logs
    assert_same_training(tmp_path / "two-nodes", reference("ltx-video"))
