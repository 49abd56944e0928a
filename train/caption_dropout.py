"""Caption dropout for classifier-free guidance: some samples train on the empty caption.

Which samples is a function of (seed, step, the sample's index in the step's global batches), drawn
from a keyed generator, so a resumed run and every parallel layout drop the same ones. The empty
caption's conditions come from the window (stage 1 stores them once, see the window's Writer.put_empty_caption);
they replace exactly the text tensors of a dropped sample, whatever the family names them.
"""

from __future__ import annotations

import torch

from vt.shared.runtime import keyed_generator


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
