"""Caption -> condition tensors, encoded once per distinct caption within a run."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TextCache:
    """`encode` is the family's text encoding of a list of captions; `batch` caps how many one call gets (None: all
    the new captions of a `fill` in one call)."""

    def __init__(
        self,
        encode: Callable[[list[str]], dict[str, torch.Tensor]],
        max_entries: int = 100_000,
        batch: int | None = None,
    ):
        self.encode_batch = encode
        self.max_entries = max_entries
        self.batch = batch
        self.entries: dict[str, dict[str, torch.Tensor]] = {}
        self.hits = 0

    def new(self, captions: list[str]) -> list[str]:
        """The distinct captions of `captions` not encoded yet, in order."""
        return list(dict.fromkeys(c for c in captions if c not in self.entries))

    def fill(self, captions: list[str]) -> None:
        """Encode the captions not seen before (in calls of at most `batch`); afterwards all of `captions` are
        cached. A full cache is emptied first, except for `captions` themselves."""
        missing = self.new(captions)
        self.hits += len(captions) - len(missing)
        if not missing:
            return
        if len(self.entries) + len(missing) > self.max_entries:
            self.entries = {c: self.entries[c] for c in dict.fromkeys(captions) if c in self.entries}
        step = self.batch or len(missing)
        for start in range(0, len(missing), step):
            chunk = missing[start : start + step]
            fresh = self.encode_batch(chunk)
            for i, caption in enumerate(chunk):
                self.entries[caption] = {k: v[i].cpu() for k, v in fresh.items()}

    def encode(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Stacked conditions for `captions`, encoding only the ones not seen before."""
        self.fill(captions)
        rows = [self.entries[c] for c in captions]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
