"""Text conditions stored once per distinct caption, trimmed to the rows a caption really has.

A real text encoder's output is as large as a latent (Wan 2.1: 512 tokens x 4096 bf16 = 4 MiB), and
most of it is padding: rows past the caption's last token. So a shard keeps a table of its distinct
captions' conditions, each trimmed, and every sample refers to a row of the table. Reading pads each
caption back to its full length with zeros and gives every sample its caption's tensors, so the
trainer sees the tensors it saw before.

What may be trimmed, per condition tensor (first per-caption dim = rows, e.g. tokens):
- trailing rows that are exactly zero (a mask's zeros, Wan's zeroed padding): trimmed and padded
  back with zeros, so the tensor comes back bit for bit;
- rows a mask declares padding (`masks`, from the family's Model Spec `text_masks`: condition ->
  the (C, L) mask the transformer applies to it): rows past the mask's last nonzero entry, which the
  transformer never reads. They come back as zeros.
Everything else (CogVideoX's unmasked T5 rows, whose padding tokens matter) is kept whole.

Layout inside the shard's safetensors (FORMAT_VERSION 2 of shared/shards.py), for C captions:
`text.<name>` (sum of kept rows, ...) the captions' kept rows one after another, `text_rows.<name>`
(C,) how many rows each caption keeps, `text_index` (B,) which caption each sample has (its first), and where a
sample has several captions `text_choices` (B, K) each sample's captions (-1 past its last; the trainer draws one per
epoch: `drawn_caption`); the full
row count of each name lives in the shard's metadata (`text_lengths`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vt.shared.runtime import keyed_generator

TEXT_PREFIX = "text."
ROWS_PREFIX = "text_rows."
INDEX = "text_index"
CHOICES = "text_choices"  # (B, K): each sample's captions (table rows, -1 past its last), when one has several


@dataclass
class Captions:
    """The text conditions of a shard's samples, one entry per distinct caption."""

    conditions: dict[str, Tensor]  # name -> (C, L, ...), caption c's tensors at [c]
    index: list[int]  # the caption of each sample, in sample order
    masks: Mapping[str, str] = field(default_factory=dict)  # the family's Model Spec `text_masks`
    choices: list[list[int]] | None = None  # each sample's captions (rows), when a sample has several

    @classmethod
    def of(
        cls, captions: list[str], encode, masks: Mapping[str, str] = {}, more: list[list[str]] | None = None
    ) -> "Captions":
        """Each distinct caption of `captions` (and of `more`: each sample's other captions) encoded once by
        `encode(list) -> {name: (C, ...)}`; with several captions of a sample, `choices` lists them."""
        per_sample = [list(dict.fromkeys([c, *(more[i] if more else [])])) for i, c in enumerate(captions)]
        distinct = list(dict.fromkeys(c for sample in per_sample for c in sample))
        row = {caption: i for i, caption in enumerate(distinct)}
        choices = [[row[c] for c in sample] for sample in per_sample]
        several = any(len(sample) > 1 for sample in choices)
        return cls(encode(distinct), [row[c] for c in captions], dict(masks), choices if several else None)


def mask_rows(mask: Tensor) -> list[int]:
    """Each caption's rows up to its mask's last nonzero entry ((B, L) masks -> B counts, 0 for none): the rows a
    transformer that takes no text mask is fed, as the pipeline feeds one prompt's. Ops on the mask alone, so
    `vt-train plan` runs it with a real mask among fake tensors."""
    used = mask.flatten(1).ne(0)
    return ((used.shape[1] - used.flip(1).to(torch.int8).argmax(dim=1)) * used.any(dim=1)).tolist()


def kept_rows(conditions: Mapping[str, Tensor], masks: Mapping[str, str] = {}) -> dict[str, Tensor]:
    """name -> (C,) int64: how many leading rows of each caption's tensor must be stored."""
    out = {}
    for name, tensor in conditions.items():
        if tensor.dim() < 2:
            raise ValueError(f"text condition {name!r} has shape {tuple(tensor.shape)}; it needs one row per caption")
        flat = tensor.reshape(tensor.shape[0], tensor.shape[1], -1)
        if name in masks:
            mask = conditions[masks[name]]
            if mask.shape[:2] != tensor.shape[:2]:
                raise ValueError(
                    f"mask {masks[name]!r} {tuple(mask.shape)} does not cover {name!r} "
                    f"{tuple(tensor.shape)} row for row"
                )
            flat = mask.reshape(mask.shape[0], mask.shape[1], -1)
        used = (flat != 0).any(dim=2)  # (C, L): rows that hold something
        positions = torch.arange(1, used.shape[1] + 1).expand_as(used)
        out[name] = (used * positions).amax(dim=1).to(torch.int64)  # last used row + 1 (0: none)
    return out


def drawn_caption(seed: int, epoch: int, key: str, count: int) -> int:
    """Which of a sample's `count` captions it trains on in data epoch `epoch`: a keyed draw of (seed, epoch, sample
    key), so every parallel layout and every resume draws the same."""
    if count <= 1:
        return 0
    return int(torch.randint(0, count, (1,), generator=keyed_generator(seed, "caption_choice", epoch, key)))


def pack(
    conditions: Mapping[str, Tensor],
    index: list[int],
    masks: Mapping[str, str] = {},
    choices: list[list[int]] | None = None,
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """(tensors to store, name -> full row count) for C captions' conditions (C, L, ...) and the
    caption `index` of each sample (and, where a sample has several captions, each one's `choices`)."""
    count = {tensor.shape[0] for tensor in conditions.values()}
    if len(count) != 1:
        raise ValueError(f"text conditions disagree on the number of captions: {sorted(count)}")
    (captions,) = count
    if not index or min(index) < 0 or max(index) >= captions:
        raise ValueError(f"caption index {index} must name captions 0..{captions - 1}")
    rows = kept_rows(conditions, masks)
    tensors = {INDEX: torch.tensor(index, dtype=torch.int64)}
    if choices is not None:
        if len(choices) != len(index) or any(not row or max(row) >= captions or min(row) < 0 for row in choices):
            raise ValueError(f"caption choices {choices} must list captions 0..{captions - 1}, one list per sample")
        width = max(len(row) for row in choices)
        tensors[CHOICES] = torch.tensor([row + [-1] * (width - len(row)) for row in choices], dtype=torch.int64)
    for name, tensor in conditions.items():
        tensors[TEXT_PREFIX + name] = torch.cat([tensor[c, : int(n)] for c, n in enumerate(rows[name])])
        tensors[ROWS_PREFIX + name] = rows[name]
    return tensors, {name: tensor.shape[1] for name, tensor in conditions.items()}


def is_text(name: str) -> bool:
    """Whether a stored tensor name belongs to the caption table rather than to the samples."""
    return name in (INDEX, CHOICES) or name.startswith((TEXT_PREFIX, ROWS_PREFIX))


def unpack(stored: Mapping[str, Tensor], lengths: Mapping[str, int]) -> dict[str, Tensor]:
    """name -> (C, L, ...) per caption, each padded back to its full length `lengths[name]` with zeros."""
    out = {}
    for name, full in lengths.items():
        rows, kept = stored[TEXT_PREFIX + name], stored[ROWS_PREFIX + name]
        if int(kept.sum()) != rows.shape[0] or (kept.numel() and int(kept.max()) > full):
            raise ValueError(
                f"caption table {name!r}: {rows.shape[0]} stored rows for kept counts {kept.tolist()} of at most {full}"
            )
        padded = rows.new_zeros((kept.shape[0], full, *rows.shape[1:]))
        start = 0
        for caption, n in enumerate(kept.tolist()):
            padded[caption, :n] = rows[start : start + n]
            start += n
        out[name] = padded
    return out


def per_sample(stored: Mapping[str, Tensor], lengths: Mapping[str, int]) -> dict[str, Tensor]:
    """name -> (B, L, ...): each sample's caption tensors, padded back (see `unpack`)."""
    index = stored[INDEX]
    return {name: table[index] for name, table in unpack(stored, lengths).items()}


def encode_caption(conditions: Mapping[str, Tensor], masks: Mapping[str, str] = {}) -> bytes:
    """One caption's conditions (1, L, ...) as a small safetensors file (the window's empty caption)."""
    import json

    from safetensors.torch import save

    tensors, lengths = pack(conditions, [0], masks)
    return save(
        {n: t.detach().cpu().contiguous() for n, t in tensors.items()},
        metadata={"format": "vt-caption", "text_lengths": json.dumps(lengths, sort_keys=True)},
    )


def decode_caption(data: bytes) -> dict[str, Tensor]:
    """name -> (L, ...): the caption of `encode_caption`, padded back."""
    import json
    import struct

    from safetensors.torch import load

    (header_len,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(bytes(data[8 : 8 + header_len])).get("__metadata__") or {}
    if metadata.get("format") != "vt-caption":
        raise ValueError("not a vt caption file (no vt-caption metadata); write it with encode_caption")
    lengths = json.loads(metadata["text_lengths"])
    return {name: tensor[0] for name, tensor in per_sample(load(bytes(data)), lengths).items()}
