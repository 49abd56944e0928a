"""Stored bytes per sample: the shard window against one fp32 `torch.save` file per sample.

vt counts everything the window holds right after precompute (shard data, commit records, producer
markers). The baseline is the common layout of other trainers: every sample's tensors (latents,
text embeddings, mask), upcast to float32, in its own `.pt` file. Rows are cloned before saving,
since torch.save of a view would write the whole stacked storage.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench_common import Row


def window_bytes(window: Path) -> dict[str, int]:
    """Bytes under the window by top-level folder (data, commits, producers) and file."""
    sizes: dict[str, int] = {}
    for path in sorted(Path(window).rglob("*")):
        if path.is_file():
            part = path.relative_to(window).parts[0]
            sizes[part] = sizes.get(part, 0) + path.stat().st_size
    return sizes


def fp32_per_sample_bytes(window: Path, out: Path) -> tuple[int, int]:
    """Write every sample of the window as its own fp32 torch.save file; (total bytes, samples)."""
    from vt.shared.shards import decode_shard

    out.mkdir(parents=True, exist_ok=True)
    total = samples = 0
    for shard in sorted((Path(window) / "data").rglob("*.safetensors")):
        tensors, keys, _ = decode_shard(shard.read_bytes())
        for row, key in enumerate(keys):
            path = out / f"{key.replace('/', '__')}.pt"  # keys are "<raw shard>/<key>"
            torch.save({name: t[row].float().clone() for name, t in tensors.items()}, path)
            total += path.stat().st_size
            samples += 1
    return total, samples


def bench_storage(window: Path, work: Path, samples: int) -> dict:
    sizes = window_bytes(window)
    if not sizes.get("data"):
        raise RuntimeError(f"the window {window} holds no shard data; run the precompute bench first")
    baseline_total, baseline_samples = fp32_per_sample_bytes(window, work / "fp32-per-sample")
    if baseline_samples != samples:
        raise RuntimeError(f"the window holds {baseline_samples} samples but precompute committed {samples}: "
                           "was it written by another run? Delete it and run the bench again")
    stored = sum(sizes.values())
    rows = [
        Row("stored bytes/sample (window, all files)", stored / samples, "B", baseline=baseline_total / samples,
            max_ratio=0.5, note="baseline: fp32 torch.save, one file per sample"),
        Row("  stored bytes/sample (shard data only)", sizes["data"] / samples, "B", baseline=baseline_total / samples),
    ]
    return {"rows": rows, "window_bytes": sizes, "fp32_total_bytes": baseline_total, "samples": samples}
