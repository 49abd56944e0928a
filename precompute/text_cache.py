"""Caption -> condition tensors, encoded once per distinct caption within a run."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TextCache:
    def __init__(self, encode: Callable[[list[str]], dict[str, torch.Tensor]], max_entries: int = 100_000):
        self.encode_batch = encode
        self.max_entries = max_entries
        self.entries: dict[str, dict[str, torch.Tensor]] = {}
        self.hits = 0

    def encode(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Stacked conditions for `captions`, encoding only the ones not seen before."""
        missing = list(dict.fromkeys(c for c in captions if c not in self.entries))
        self.hits += len(captions) - len(missing)
        if missing:
            fresh = self.encode_batch(missing)
            if len(self.entries) + len(missing) > self.max_entries:
                self.entries.clear()
            for i, caption in enumerate(missing):
                self.entries[caption] = {k: v[i].cpu() for k, v in fresh.items()}
        rows = [self.entries[c] for c in captions]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
