"""What made a latent shard: the settings both stages must agree on, and its fingerprint.

The producer stores the provenance in every shard and its fingerprint in every commit record; the
trainer computes the same from its own config and refuses shards whose fingerprint differs, naming
the settings that differ, so a cache never goes stale silently.
"""

from __future__ import annotations

import hashlib
import json

from vt.shared.config import Config
from vt.shared.shards import FORMAT_VERSION


def provenance(config: Config, weights: dict[str, str] | None = None) -> dict:
    """The settings that decide a shard's content. `weights`: component name -> weights digest."""
    return {
        "format_version": FORMAT_VERSION,
        "family": config.model.family,
        "task": config.model.task,
        "max_text_tokens": config.model.max_text_tokens,
        "encoder_dtype": config.model.dtype,
        "buckets": sorted(config.buckets.sizes),
        "fps": config.buckets.fps,
        "storage_dtype": config.precompute.storage_dtype,
        "weights": dict(sorted((weights or {}).items())),
    }


def fingerprint(prov: dict) -> str:
    return hashlib.sha256(json.dumps(prov, sort_keys=True).encode()).hexdigest()[:16]


def describe_difference(expected: dict, found: dict) -> str:
    keys = sorted(set(expected) | set(found))
    diffs = [f"{k}: shard has {found.get(k)!r}, config wants {expected.get(k)!r}"
             for k in keys if expected.get(k) != found.get(k)]
    return "; ".join(diffs) or "fingerprints differ but the recorded settings match (format change?)"
