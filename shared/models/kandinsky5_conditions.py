"""What Kandinsky 5 and 6 read beside the latents: the i2v first frame's latents, each caption's text rows (stage 1
stores them padded), and their transformers' channel-last input."""

from __future__ import annotations

import torch
from torch import Tensor

from vt.shared.caption_table import mask_rows
from vt.shared.errors import UserError
from vt.shared.models.frame_conditions import FrameConditions


def image_latents(batch: dict[str, Tensor], conditions: FrameConditions) -> Tensor:
    conditions.require(batch, "image_latents")
    return batch["image_latents"]


def caption_lengths(mask: Tensor) -> list[int]:
    """Each sample's text rows (`mask_rows`); an empty caption (all-zero mask) is refused."""
    lengths = mask_rows(mask)
    empty = [row for row, length in enumerate(lengths) if length == 0]
    if empty:
        raise UserError(
            f"samples {empty} have no text rows (an all-zero prompt_attention_mask): stage 1 stores "
            "at least the template's closing token per caption; re-run stage 1 for these shards"
        )
    return lengths


def channel_last(transformer, latents: Tensor, mask_frame: int | None) -> Tensor:
    """(B, C, F, H, W) -> the channel-last input; with `visual_cond` [latents, zeros, mask 1 on frame `mask_frame`]."""
    latents = latents.permute(0, 2, 3, 4, 1)
    if not transformer.config.visual_cond:
        return latents
    mask = latents.new_zeros(*latents.shape[:-1], 1)
    if mask_frame is not None:
        mask[:, mask_frame] = 1.0
    return torch.cat([latents, torch.zeros_like(latents), mask], dim=-1)
