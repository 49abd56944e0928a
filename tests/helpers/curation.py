"""The chain of every curation processor (issue 40: split_scenes, the filters, dedup) that the fault and resume
tests run, so crashes, restarts, lane take-overs and S3 faults are shown not to break them.

Its thresholds let every piece of the `raw_shards` fixture through, so those tests' counts hold: split_scenes with a
threshold no frame change reaches (each piece is one scene, keyed `<key>#s0`; detection itself is tested in
tests/precompute/test_scenes_and_filters.py), the filters' defaults and bounds the demo pieces pass, and dedup
with `max_distance = 0` (the demo's carphone_distorted pieces are carphone_pristine re-compressed, a few bits
away, and would be rejected at the default). dedup claims its hashes in the window's storage: a producer that
restarts, or a second epoch, finds its own claims and keeps its samples.
"""

from __future__ import annotations

EVERY_PROCESSOR = [
    {"name": "split_scenes", "threshold": 255.0, "min_seconds": 1.0, "detect_width": 32},
    {"name": "filter_size", "min_seconds": 1.0, "min_height": 32, "min_width": 32},
    {"name": "decode"},
    {"name": "filter_black"},
    {"name": "filter_frozen"},
    {"name": "filter_motion", "min_motion": 0.1, "max_motion": 100.0},
    {"name": "dedup", "max_distance": 0},
]


def scene_keys(keys: set[str]) -> set[str]:
    """The keys samples get through EVERY_PROCESSOR: each raw key's one scene."""
    return {f"{key}#s0" for key in keys}
