"""`python pp_startup_worker.py JOBS OUT` under torchrun (2 ranks): each job's config started under parallel.pp = 2.

JOBS is a JSON list of {"name", "config", "sets", "export"}. For each, the trainer is built (start-up: world, spec,
pipeline-stage checks, model laid out over the stages, validator). A start-up refused with a ValueError is
recorded with its message; one that starts runs one transformer forward of the family (`spec.forward` on a
batch of the config's first bucket) through the stages as validation runs it (`staged_inference`), and the
same forward on the same model built without stages (the trainer's own build, pp = 1), for the trained
transformer and, in a one-expert run, the frozen other expert validation renders with: the largest
difference and the prediction's scale are recorded; both models' full weights are exported (`export/pp`,
`export/one` under the job's "export" folder) for the test to compare file by file. Rank 0 writes OUT
(JSON, name -> record); any other exception fails the run.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from types import SimpleNamespace

import torch


def batch_for(spec, bucket) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A one-sample batch of what stage 1 stores for `bucket` (masks all ones), sigmas and noise: seeded."""
    generator = torch.Generator().manual_seed(0)
    shapes = spec.condition_shapes(bucket)
    if "audio_latents" in shapes:
        shapes = {**shapes, "audio_noise": shapes["audio_latents"]}
    batch = {
        name: torch.ones(1, *shape) if "mask" in name else torch.randn(1, *shape, generator=generator)
        for name, shape in shapes.items()
    }
    levels = spec.noise_levels(shapes["latents"])
    sigmas = torch.full((1, levels) if levels > 1 else (1,), 0.6)
    noise = torch.randn(1, *shapes["latents"], generator=generator)
    return batch, sigmas, noise


def unstaged(trainer, component: str, mode: str):
    """Transformer `component` as the trainer builds it in one process (same weights and adapters), without
    stages; `mode` "lora", "full" or "frozen" (a one-expert run's other expert)."""
    from vt.train.attention import set_backend
    from vt.train.model_build import build_transformer

    train = trainer.config.train
    world = SimpleNamespace(dims=SimpleNamespace(fsdp_enabled=False, tp=1), device=trainer.device, is_main=False)
    adapter = trainer.config.adapter
    lora = {"rank": adapter.rank, "alpha": adapter.alpha, "targets": adapter.targets}
    model = build_transformer(
        trainer.spec,
        component,
        world,
        mode=mode,
        lora=lora,
        storage_dtype=trainer.dtypes.storage(mode),
        compute_dtype=trainer.dtypes.compute,
        frozen_dtype=trainer.dtypes.frozen,
        parallelize=lambda m, fill: fill(m),
        seed=train.seed,
    )
    set_backend(model, train.attention_backend)
    return model.eval()


EXPORT_FILE_BYTES = 2**16  # small files: every tiny transformer's export spans several, with an index


def export_both(trainer, reference, folder: str) -> None:
    """The full weights of the stage-split transformer (folder/pp) and of the one-piece one (folder/one)."""
    from pathlib import Path

    from vt.shared.models.components import keeps_float32
    from vt.train.export import write_full_weights

    for name, model in (("pp", trainer.transformer), ("one", reference)):

        def dtype_of(key, tensor, model=model):  # as the trainer's export
            return torch.float32 if keeps_float32(model, key) else trainer.spec.frozen_dtype

        write_full_weights(model, Path(folder) / name, dtype_of, max_file_bytes=EXPORT_FILE_BYTES)


@torch.no_grad()
def compare(trainer, export_to: str) -> dict:
    from vt.train.parallel.pp_validation import staged_inference

    spec = trainer.spec
    batch, sigmas, noise = batch_for(spec, trainer.buckets[0])
    amp = trainer.amp_dtype

    def predict(model):
        torch.manual_seed(0)
        with torch.autocast(trainer.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            return spec.forward(
                model, batch, sigmas, noise, generators=[torch.Generator().manual_seed(0) for _ in sigmas]
            ).prediction

    # The trained transformer and, in a one-expert run, the other expert validation renders with (split too).
    models = {
        spec.trained_component: (trainer.transformer, trainer.config.train.mode),
        **{component: (model, "frozen") for component, model in trainer.setup.untrained_experts().items()},
    }
    record = {"max_diff": 0.0, "scale": 0.0, "finite": True, "models": len(models)}
    for component, (model, mode) in models.items():
        model.eval()
        with staged_inference([model], trainer.device):
            staged = predict(model)
        reference = unstaged(trainer, component, mode)
        alone = predict(reference)
        record["max_diff"] = max(record["max_diff"], float((staged - alone).abs().max()))
        record["scale"] = max(record["scale"], float(alone.abs().max()))
        record["finite"] &= bool(torch.isfinite(staged).all())
        if model is trainer.transformer:
            export_both(trainer, reference, export_to)
    return record


def main(jobs_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from vt.shared.config import load_config
    from vt.train.trainer import Trainer

    results = {}
    for job in json.loads(open(jobs_path).read()):
        config = load_config(job["config"], [*job["sets"], "parallel.pp=2", "parallel.dp_shard=1"])
        try:
            trainer = Trainer(config)
        except ValueError as err:
            results[job["name"]] = {"refused": str(err)}
        else:
            results[job["name"]] = {"started": True, **compare(trainer, job["export"])}
            del trainer
        print(f"rank {dist.get_rank()} {job['name']}: {results[job['name']]}", flush=True)
        gc.collect()
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
