"""Under torchrun: build the trainer's sharded (FSDP2) LoRA transformer of CONFIG, filled either way
(`slices`: every rank reads its own blocks; `rank0`: rank 0 reads whole tensors and scatters them), and
write the seconds it took and this job's largest peak resident set beyond imports to OUT (JSON, rank 0).

    torchrun --nproc-per-node 2 scripts/bench_fill_worker.py CONFIG slices|rank0 OUT
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch.distributed as dist

from vt.shared.config import load_config
from vt.shared.models import spec_for
from vt.train import model_build
from vt.train.parallel import parallelize
from vt.train.parallel.world import setup_world


def main(config_path: str, how: str, out: str) -> None:
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = load_config(config_path)
    world = setup_world(config.parallel, "cpu")
    spec = spec_for(config)
    dist.barrier()
    started = time.perf_counter()
    model = model_build.prepare_transformer(
        spec,
        "transformer",
        mode="lora",
        lora={"rank": 16, "alpha": 16.0, "targets": []},
        storage_dtype=None,
        sharded=True,
        compute_dtype=spec.frozen_dtype,
        frozen_dtype=spec.frozen_dtype,
    )
    weights = spec.weights("transformer")

    def materialize(laid_out):
        model_build.materialize(laid_out, world.device)
        model_build.fill(laid_out, weights, seed=0, key="transformer", fill_from=how)

    parallelize(model, spec, world, materialize=materialize)
    dist.barrier()
    seconds = time.perf_counter() - started
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) * 1024
    peaks = world.gather_floats(peak)
    if world.is_main:
        Path(out).write_text(json.dumps({"seconds": seconds, "peak_bytes": max(peaks), "peaks": peaks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
