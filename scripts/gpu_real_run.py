"""gpu_check's "run" rows: `vt-train run` itself, under torchrun on every GPU of the machine, at real size.

Each row takes the path a user's first run takes, from start-up to validation and export:
1. a model folder at the real configs (scripts/real_models.json): the transformer and the VAE with random
   weights (initialised on the GPU, saved in bf16 diffusers layout: ~28 GB for Wan 2.1 14B), the text
   encoders as config files only: the trainer needs none of their weights (train/window_match.py);
2. a kept window of random latents of the row's bucket, whose text conditions, empty caption and
   validation prompts come from the family's own stage-1 code (`encode_text`, precompute's
   `write_validation_conditions`) run by its text encoders built at their real config with random weights
   on the device, then freed: the names and shapes stage 1 stores, without the encoders' files;
3. `torchrun --nproc-per-node G -m vt.train run CONFIG`: LoRA rank 32 with activation checkpointing, a few
   steps, then validation (2 denoising steps) and the export. The row shows the run's measured GPU peak
   (memory.json, the largest rank's), what `vt-train plan` says for the same config and G, the step time
   (metrics.jsonl, median after the first step) and MFU (forward FLOPs counted on fake tensors, x3).

`--dry`: the families' tiny presets on the CPU, one gloo process, tiny buckets: the same path end to end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import popen, wait_or_kill  # noqa: E402

# the dry run's bucket: the smallest clip every row's family takes (latent 2 x 4 x 4 for Wan), so the dry run
# shows each row's path, not its speed
DRY_BUCKET = "5x32x32"
# row -> (real model of scripts/real_models.json, its bucket, the dry run's bucket)
RUNS = {
    "run, Wan 2.1 14B LoRA": ("wan2.1-14b", "81x480x832", DRY_BUCKET),
    "run, HunyuanVideo 1.5 480p LoRA": ("hunyuanvideo1.5-480p-t2v", "121x480x848", DRY_BUCKET),
    "run, Wan 2.1 14B LoRA, one GPU capped at 24 GiB": ("wan2.1-14b", "81x480x832", DRY_BUCKET),
    "run, Wan 2.1 14B LoRA, NF4 base, one GPU capped at 24 GiB": ("wan2.1-14b", "81x480x832", DRY_BUCKET),
}
# rows on one GPU under a memory cap: (GiB, the parts' settings docs/memory.md names for that card, a name for the run
# folder beside the cap's where the settings are not the card's usual ones)
CAPPED = {
    "run, Wan 2.1 14B LoRA, one GPU capped at 24 GiB": (
        24,
        {"block_swap": {"blocks_on_gpu": 10}, "activation_offload": {"enabled": True}},
        "",
    ),
    "run, Wan 2.1 14B LoRA, NF4 base, one GPU capped at 24 GiB": (
        24,
        {"activation_offload": {"enabled": True}, "frozen_base": {"quantize": "nf4"}},
        "nf4",
    ),
}
PROMPT = "a red fox running through fresh snow, cinematic"
STEPS = 4


def real_models() -> dict:
    return json.loads((ROOT / "scripts" / "real_models.json").read_text())


def model_folder(key: str, folder: Path, dry: bool, device: str) -> Path:
    """The row's model: the tiny preset (dry), else the real configs with random transformer and VAE weights."""
    import torch

    if (folder / ".done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    family = real_models()[key]["family"]
    if dry:
        from make_tiny_model import make_tiny_model

        make_tiny_model(family, folder, seed=0)
    else:
        from memory_table import config_only_model

        config_only_model(key, folder)
        from vt.shared.config import ModelConfig
        from vt.shared.models import build_spec

        spec = build_spec(ModelConfig(family=family, path=str(folder)), frame_rate=16.0)
        for name in (spec.trained_component, "vae"):
            cls = spec.class_of(name)
            torch.manual_seed(0)
            with torch.device(device):  # random init on the GPU: seconds, not the CPU's minutes
                module = cls.from_config(spec.load_config(name)).to(torch.bfloat16)
            module.save_pretrained(folder / name, safe_serialization=True, max_shard_size="10GB")
            del module
            torch.cuda.empty_cache()
    (folder / ".done").write_text("ok\n")
    return folder


def run_config(
    folder: Path,
    key: str,
    bucket: str,
    run_dir: Path,
    window: Path,
    gpus: int,
    dry: bool,
    sections: dict | None = None,
) -> Path:
    from vt.shared.config import Config, build, to_toml

    tree = {
        "run": {"dir": str(run_dir)},
        "model": {"family": real_models()[key]["family"], "path": str(folder), "dtype": "bfloat16"},
        "data": {"raw": str(window / "no-raw")},
        "buckets": {"sizes": [bucket], "fps": 16.0},
        "window": {"uri": str(window), "size": "keep"},
        "train": {
            "mode": "lora",
            "batch_size": gpus,
            "max_steps": STEPS,
            "lr": 1e-5,
            "device": "cpu" if dry else "cuda",
            "mixed_precision": "auto",
        },
        "adapter": {"rank": 32, "alpha": 32.0},
        "validation": {"prompts": [PROMPT], "steps": 2},
        "parallel": {"activation_checkpointing": True},
        **(sections or {}),
        "log": {"every_steps": 1, "progress": False},
    }
    path = run_dir.with_suffix(".toml")
    path.write_text(to_toml(build(Config, tree)))
    return path


def random_text_encoders(spec, device: str) -> dict:
    """The stage-1 text parts: tokenizers from the folder, encoders built at their config with random weights
    on `device` (normal(0, 0.02) matrices, ones elsewhere: finite conditions of the real names and shapes),
    and the VAE."""
    import torch

    encoders = {}
    for name in spec.text_parts():
        cls = spec.class_of(name)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            encoders[name] = spec.load_component(name)
            continue
        module = spec.empty_component(name, torch.bfloat16 if device != "cpu" else torch.float32)
        module.to_empty(device=device)
        with torch.no_grad():
            generator = torch.Generator(device).manual_seed(0)
            for param in module.parameters():
                if param.ndim >= 2:
                    param.normal_(0.0, 0.02, generator=generator)
                else:
                    param.fill_(1.0)
        encoders[name] = module.requires_grad_(False).eval()
    encoders["vae"] = spec.load_component("vae", device)  # some families' text pipelines read its config
    return encoders


def fill_window(config, window_dir: Path, samples: int, device: str) -> str:
    """A kept window of `samples` samples of the config's one bucket (random latents, the family's text
    conditions of two captions), the empty caption and the validation prompt; returns its fingerprint."""
    import torch

    from vt.precompute.validation_conditions import write_validation_conditions
    from vt.shared.buckets import parse_buckets
    from vt.shared.caption_table import Captions, encode_caption
    from vt.shared.models import spec_for
    from vt.shared.provenance import component_records, fingerprint, provenance
    from vt.shared.shards import encode_shard
    from vt.shared.window import open_writer

    spec = spec_for(config)
    bucket = parse_buckets(config.buckets.sizes)[0]
    components = component_records(spec)
    prov = provenance(config, {name: c.pop("digest") for name, c in components.items()}, spec)
    fp = fingerprint(prov)
    window = open_writer(str(window_dir), size="keep")
    window.acquire(0)
    window.register_producer(0, 1, fp)
    encoders = random_text_encoders(spec, device)
    with torch.inference_mode():

        def encode(captions):
            return {
                k: v.to("cpu", torch.bfloat16) if v.is_floating_point() else v.cpu()
                for k, v in spec.encode_text(encoders, captions).items()
            }

        window.put_empty_caption(fp, encode_caption(encode([""]), spec.text_masks))
        write_validation_conditions(spec, encoders, config, window, fp, torch.bfloat16)
        captions = Captions.of([f"caption {i % 2}" for i in range(samples)], encode, spec.text_masks)
    encoders.clear()  # freed before training
    if device != "cpu":
        torch.cuda.empty_cache()
    shapes = {name: shape for name, shape in spec.condition_shapes(bucket).items() if name not in captions.conditions}
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.ones(samples, *shape)
        if "mask" in name
        else torch.randn(samples, *shape, generator=generator).to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    keys = [f"sample-{i}" for i in range(samples)]
    meta = {"provenance": prov, "sources": components, "bucket": bucket.name, "epoch": 0}
    window.commit(0, 0, 0, encode_shard(tensors, keys, meta, captions), bucket.name, keys, fp)
    window.finish_producer(0, 1)
    return fp


def forward_flops(config, bucket: str) -> float | None:
    """Forward FLOPs of the trained transformer on one sample of `bucket`, counted on fake tensors (no memory,
    no compute); None where the counter cannot follow the model."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from vt.shared.buckets import parse_buckets
    from vt.shared.memory_trace import KnownValues, fake_mode, fake_parameters
    from vt.shared.models import spec_for
    from vt.train.plan import _batch

    spec = spec_for(config)
    shapes = spec.condition_shapes(parse_buckets([bucket])[0])
    model = spec.empty_component(spec.trained_component, torch.bfloat16)
    try:
        with fake_mode():
            fake_parameters(model)
            batch = _batch(shapes, 1)
            with KnownValues(), FlopCounterMode(display=False) as counter, torch.no_grad():
                spec.forward(model, batch, torch.full((1,), 0.5), torch.zeros_like(batch["latents"]))
        return float(counter.get_total_flops())
    except Exception as err:  # a data-dependent op on fake tensors: no MFU for this row
        print(f"  (forward FLOPs not counted: {type(err).__name__}: {str(err).splitlines()[0][:80]})")
        return None


def measured(run_dir: Path, gpus: int) -> dict:
    memory = json.loads((run_dir / "memory.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["samples_s"] for r in records if "samples_s" in r][1:] or [r["samples_s"] for r in records]
    step_s = statistics.median(gpus / rate for rate in rates)  # batch_size = gpus: one sample per rank
    largest = {name: max(values) for name, values in memory.items()}  # memory.json's figures are GiB
    return {
        "step_s": step_s,
        "peak_gib": largest.get("gpu_peak_gb"),
        "startup_gib": largest.get("gpu_startup_peak_gb"),
        "host_gib": largest.get("host_peak_gb"),
        "pinned_gib": largest.get("host_pinned_gb"),
        "losses": [r["loss"] for r in records if "loss" in r],
    }


def _gpu_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info()[1]


def reuse_or_fill_window(config, window_dir: Path, samples: int, device: str, filled: dict) -> None:
    """The row's window: a copy of the one window filled (fill_window) for its stage-1 fingerprint and size in
    this run (`filled`: (fingerprint, samples) -> that window, kept untouched beside the rows' copies). The Wan
    rows differ in their training settings only, so their windows are equal: each family's random text
    encoders are built once."""
    from vt.shared.models import spec_for
    from vt.shared.provenance import component_records, fingerprint, provenance

    spec = spec_for(config)
    digests = {name: record["digest"] for name, record in component_records(spec).items()}
    key = (fingerprint(provenance(config, digests, spec)), samples)
    if key not in filled:
        filled[key] = window_dir.parent / f"window-{key[0]}-{samples}"
        shutil.rmtree(filled[key], ignore_errors=True)
        fill_window(config, filled[key], samples, device)
    shutil.copytree(filled[key], window_dir)


def run_row(
    label: str,
    work: Path,
    dry: bool,
    gpus: int,
    peak_tflops: float | None,
    timeout: float,
    filled: dict | None = None,
    launch=None,
) -> dict:
    """One row: build (or reuse) the model and window, run vt-train under torchrun, read what it measured
    (`filled`: the windows of the rows before, see reuse_or_fill_window; `launch(command, log, env)` starts the
    torchrun command, default bench_common.popen: a fresh process)."""
    from vt.shared.buckets import parse_buckets
    from vt.shared.config import load_config
    from vt.train.plan import make_plan

    key, bucket, dry_bucket = RUNS[label]
    bucket = dry_bucket if dry else bucket
    device = "cpu" if dry else "cuda"
    cap_gib, sections, settings = CAPPED.get(label, (None, {}, ""))
    gpus = 1 if cap_gib else gpus
    row = {"case": label, "group": "run", "gpus": gpus}
    slug = key.replace(".", "_")
    folder = model_folder(key, work / f"{slug}-{'tiny' if dry else 'real'}", dry, device)
    slug += (f"-cap{cap_gib}" + (f"-{settings}" if settings else "")) if cap_gib else ""
    run_dir, window = work / f"{slug}-run", work / f"{slug}-window"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(window, ignore_errors=True)
    config_path = run_config(folder, key, bucket, run_dir, window, gpus, dry, sections)
    config = load_config(config_path)
    reuse_or_fill_window(config, window, gpus * (STEPS + 1), device, filled if filled is not None else {})
    budget = None if dry else int(cap_gib * 2**30) if cap_gib else _gpu_bytes()  # "auto" VAE tiling, as the run
    plan = make_plan(config, gpus, device="cpu" if dry else "cuda", stage1=False, budget=budget)
    row["validation_tiled"] = plan.vae_tiled
    row["plan_gib"] = plan.rank.device_total / 2**30
    row["plan_startup_gib"], row["plan_host_gib"] = plan.rank.startup / 2**30, plan.rank.host_peak / 2**30
    row["plan_pinned_gib"] = (plan.rank.swapped + plan.rank.offloaded) / 2**30
    tokens, flops = _tokens(config, parse_buckets([bucket])[0]), forward_flops(config, bucket)
    started = time.perf_counter()
    log = run_dir.with_suffix(".log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    trainer = [str(ROOT / "scripts" / "gpu_capped_run.py"), str(cap_gib)] if cap_gib else ["-m", "vt.train"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        *trainer,
        "run",
        str(config_path),
    ]
    code = wait_or_kill((launch or popen)(command, log, env), timeout)
    row["wall_s"] = time.perf_counter() - started
    if not dry and not any(RUNS[other][0] == key for other in list(RUNS)[list(RUNS).index(label) + 1 :]):
        shutil.rmtree(folder, ignore_errors=True)  # tens of GB of random weights, once no later row uses them
    if code != 0:
        row["note"] = f"vt-train exited {code}: " + log.read_text().strip().splitlines()[-1][:100]
        return row
    row.update(measured(run_dir, gpus))
    row.update(
        tokens=tokens,
        step_ms=row["step_s"] * 1e3,
        tokens_s=tokens * gpus / row["step_s"],
        videos=len(list((run_dir / "validation").glob("step-*/*.mp4"))),  # the trained model's (base/ apart)
        base_videos=len(list((run_dir / "validation" / "base").glob("*.mp4"))),
    )
    # each rank trains one sample a step: 3 x its forward FLOPs per step against one GPU's peak
    row["mfu"] = (3 * flops / row["step_s"] / (peak_tflops * 1e12)) if flops and peak_tflops else None
    finite = all(math.isfinite(v) for v in row["losses"])
    row["note"] = ("" if finite else "loss not finite; ") + (
        f"plan {row['plan_gib']:.1f} GiB on {gpus} GPU(s), {row['videos']} validation video(s) and"
        f" {row['base_videos']} of the base"
    )
    if cap_gib and not dry:  # what the first 24 GB card meets: start-up, page-locked host memory, beside the plan
        row["note"] += (
            f"; start-up {row['startup_gib']:.1f} GiB (plan {row['plan_startup_gib']:.1f}), pinned "
            f"{row['pinned_gib']:.1f} GiB (plan {row['plan_pinned_gib']:.1f}), host peak "
            f"{row['host_gib']:.1f} GiB (plan {row['plan_host_gib']:.1f} + the process)"
        )
    return row


def _tokens(config, bucket) -> int:
    from vt.shared.models import spec_for

    spec = spec_for(config)
    return spec.tokens_per_sample(spec.latent_shape(bucket))


def run_rows(dry: bool, work: Path, peak_tflops: float | None, timeout: float = 1800, launch=None) -> list[dict]:
    """Every row of RUNS in order; `launch(command, log, env)` starts each row's torchrun command (default: a
    fresh process; the suite's dry run forks the ranks of some rows from a warm interpreter instead)."""
    import torch

    gpus = 1 if dry else max(1, torch.cuda.device_count())
    work.mkdir(parents=True, exist_ok=True)
    filled: dict = {}
    return [run_row(label, work, dry, gpus, peak_tflops, timeout, filled, launch) for label in RUNS]
