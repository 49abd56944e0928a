"""Caption dropout for classifier-free guidance: some samples train on the empty caption.

Which samples is a function of (seed, step, the sample's index in the step's global batches), drawn
from a keyed generator, so a resumed run and every parallel layout drop the same ones. The empty
caption's conditions come from the window (stage 1 stores them once, see the window's Writer.put_empty_caption);
they replace exactly the text tensors of a dropped sample, whatever the family names them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vt.shared.errors import UserError
from vt.shared.runtime import keyed_generator
from vt.train.parts.base import Part, RunContext


def dropped(seed: int, step: int, index: int, rate: float) -> bool:
    """Whether global sample `index` of optimizer step `step` trains on the empty caption."""
    if rate <= 0:
        return False
    return torch.rand((), generator=keyed_generator(seed, "caption_dropout", step, index)).item() < rate


def drop_captions(
    tensors: dict[str, torch.Tensor], empty: dict[str, torch.Tensor], rows: list[int]
) -> dict[str, torch.Tensor]:
    """`tensors` (one row per sample) with the text tensors of `rows` replaced by `empty`'s (a new dict)."""
    if not rows:
        return tensors
    out = dict(tensors)
    for name, value in empty.items():
        if name not in tensors:
            raise KeyError(
                f"the window's empty caption has {name!r} but the shards' samples do not: "
                "were they made by another model? Re-run vt-precompute into a fresh window"
            )
        column = tensors[name].clone()
        column[rows] = value.to(column)
        out[name] = column
    return out


class CaptionDropoutPart(Part):
    """caption_dropout.rate of each global micro-batch's samples on the window's empty caption, drawn per (seed,
    step, sample): every rank drops alike, and a resumed run drops what the uninterrupted one did."""

    section = "caption_dropout"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.caption_dropout.rate > 0

    def check(self, spec, world_size: int) -> None:
        if spec.text_with_image:
            raise UserError(
                f"caption_dropout.rate = {self.settings.rate}: {spec.family}'s text encoder reads each caption "
                "together with its clip's first frame, so the window's empty caption cannot stand in for a "
                "sample's text; set caption_dropout.rate = 0"
            )

    def start(self, run: RunContext) -> None:
        self.empty_caption = run.empty_caption

    def batch(self, batch, first: int, step: int):
        """`batch` with its dropped samples on the empty caption; `first` is the global index of its first sample
        in optimizer step `step`."""
        seed, rate = self.config.train.seed, self.settings.rate
        held = range(batch.first, batch.first + next(iter(batch.tensors.values())).shape[0])  # this rank's rows
        rows = [row - batch.first for row in held if dropped(seed, step, first + row, rate)]
        if not rows:
            return batch
        return replace(batch, tensors=drop_captions(batch.tensors, self.empty_caption(), rows))
