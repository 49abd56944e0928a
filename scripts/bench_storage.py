"""Stored bytes per sample: the shard window against one fp32 `torch.save` file per sample.

vt counts everything the window holds right after precompute (shard data, commit records, producer
markers, the empty caption). The baseline is the common layout of other trainers: every sample's
tensors (latents, text embeddings, mask), upcast to float32, in its own `.pt` file. Rows are cloned
before saving, since torch.save of a view would write the whole stacked storage.

`wan21_layout_bytes` adds what a sample of the real Wan 2.1 config takes in a shard, measured by
encoding tensors of its shapes: the version-1 layout (padded text per sample) against this one
(text once per caption, trimmed).
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
        raise RuntimeError(
            f"the window holds {baseline_samples} samples but precompute committed {samples}: "
            "was it written by another run? Delete it and run the bench again"
        )
    stored = sum(sizes.values())
    rows = [
        Row(
            "stored bytes/sample (window, all files)",
            stored / samples,
            "B",
            baseline=baseline_total / samples,
            max_ratio=0.25,
            note="baseline: fp32 torch.save, one file per sample",
        ),
        Row("  stored bytes/sample (shard data only)", sizes["data"] / samples, "B", baseline=baseline_total / samples),
    ]
    wan = wan21_layout_bytes()
    rows.append(
        Row(
            f"  Wan 2.1 {wan['bucket']} shard bytes/sample (layout)",
            wan["after"],
            "B",
            baseline=wan["before"],
            note=f"baseline: v1 layout, text padded per sample; {wan['tokens']}-token captions",
        )
    )
    return {
        "rows": rows,
        "window_bytes": sizes,
        "fp32_total_bytes": baseline_total,
        "samples": samples,
        "wan21_layout": wan,
    }


def wan21_layout_bytes(samples: int = 4, tokens: int = 120, bucket: str = "81x480x832") -> dict:
    """Shard bytes per sample for Wan 2.1 (VAE 4x8x8 to 16 channels, UMT5-XXL 512 x 4096), bf16, each
    sample with its own caption of `tokens` tokens (Wan zeroes the rows past them): the padded
    per-sample text of layout version 1 against the trimmed caption table."""
    from vt.shared.buckets import Bucket
    from vt.shared.caption_table import Captions
    from vt.shared.shards import encode_shard

    frames, height, width = Bucket.parse(bucket).frames, Bucket.parse(bucket).height, Bucket.parse(bucket).width
    latents = torch.zeros(samples, 16, (frames - 1) // 4 + 1, height // 8, width // 8, dtype=torch.bfloat16)
    text = torch.zeros(samples, 512, 4096, dtype=torch.bfloat16)
    text[:, :tokens] = 1.0
    keys = [f"s{i}" for i in range(samples)]
    before = encode_shard({"latents": latents, "prompt_embeds": text}, keys, {})
    after = encode_shard({"latents": latents}, keys, {}, Captions({"prompt_embeds": text}, list(range(samples))))
    return {
        "bucket": bucket,
        "tokens": tokens,
        "before": len(before) / samples,
        "after": len(after) / samples,
        "latent_bytes": latents[0].numel() * 2,
        "text_bytes": text[0].numel() * 2,
    }
