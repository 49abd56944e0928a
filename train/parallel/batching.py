"""A global batch -> this rank's slice, and noise that does not depend on how the batch was sliced.

Every rank reads the same global batches (one bucket each), so all ranks use the same bucket at a
micro-step. Data-parallel rank d of D takes a contiguous slice; ranks of one cp or tp group have the
same d and so the same samples. Slices differ by at most one sample, so a final batch that does
not divide by D still trains every sample exactly once. A rank whose slice is empty (a batch
smaller than D) runs one stand-in sample with weight 0: it keeps the collectives in step and adds
nothing to the loss or the gradients.

Loss normalisation: each rank's loss is the sum of its per-sample losses divided by the number of
samples in the whole optimizer step (all ranks, all micro-steps), times the data-parallel degree D.
DDP / FSDP average gradients over the D ranks, which yields exactly the gradient of the mean
per-sample loss of one process seeing the whole step: N ranks x B/N samples = 1 rank x B samples,
and grad accumulation over k micro-batches = one batch k times as large. (Context parallel keeps
this: its gathered output scales each cp rank's gradient by cp, which the averaging over the cp
ranks that FSDP also spans divides out again; tensor-parallel ranks are not averaged.)

Noise and sigmas are drawn per sample from a generator keyed by (seed, step, index of the sample in
the optimizer step): reproducible on resume, different on every data-parallel rank (they hold
different samples), and identical for any world size, slicing or accumulation of the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vt.shared.runtime import keyed_generator
from vt.train.objectives import sample_noise, sample_sigmas

if TYPE_CHECKING:
    from vt.train.data import Batch


@dataclass
class Slice:
    """This rank's part of one global micro-batch."""

    bucket: str
    epoch: int
    keys: list[str]  # the samples this rank trains on (empty for a stand-in)
    tensors: dict[str, torch.Tensor]  # at least one row (the stand-in when `count` is 0)
    first_index: int  # index of the first row in the optimizer step (noise key)
    count: int  # real samples: the slice's weight in the loss


def slice_bounds(n: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """[start, stop) of data-parallel rank `dp_rank` in a batch of `n`: sizes differ by at most one."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    base, extra = divmod(n, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return start, start + base + (dp_rank < extra)


def take_slice(batch: "Batch", dp_rank: int, dp_size: int, offset: int = 0) -> Slice:
    """This rank's rows of `batch`; `offset` = samples of the step's earlier micro-batches.

    `batch.tensors` hold the batch's rows from `batch.first` on: all of them, or (the trainer's reader)
    only this rank's slice, or the batch's row 0 where the slice is empty."""
    start, stop = slice_bounds(len(batch), dp_rank, dp_size)
    count = stop - start
    rows = slice(start, stop) if count else slice(0, 1)  # stand-in: the batch's first row, weight 0
    held = next(iter(batch.tensors.values())).shape[0]
    if rows.start < batch.first or rows.stop > batch.first + held:
        raise ValueError(
            f"batch rows {rows.start}..{rows.stop - 1} were not read: it holds rows "
            f"{batch.first}..{batch.first + held - 1} (another rank's slice?)"
        )
    local = slice(rows.start - batch.first, rows.stop - batch.first)
    tensors = {name: t[local] for name, t in batch.tensors.items()}
    return Slice(batch.bucket, batch.epoch, batch.keys[start:stop], tensors, offset + rows.start, count)


def sample_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The generator of sample `index` of optimizer step `step` (same on every rank and world size)."""
    return keyed_generator(seed, step, "sample", index)


def draw_inputs(
    part: Slice,
    seed: int,
    step: int,
    scheme: str,
    shift: float,
    sigma_range: tuple[float, float] = (0.0, 1.0),
    levels: int = 1,
    **density,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, noise like latents) for the rows of `part`, one generator per sample.

    `sigma_range` (low, high) maps the drawn sigmas affinely into that range: an expert trained on
    part of the noise levels keeps the scheme's shape within its own. `levels`: the spec's
    `noise_levels` per sample; sigmas are (n,) for 1, else (n, levels) (diffusion forcing: one per
    latent frame), each sample's drawn from its own generator before its noise, so every layout
    draws the same. `density`: the scheme's parameters (`sample_sigmas`: logit_mean, logit_std, mode_scale).
    """
    latents = part.tensors["latents"]
    low, high = sigma_range
    sigmas, noise = [], []
    for row in range(latents.shape[0]):
        generator = sample_generator(seed, step, part.first_index + row)
        drawn = low + (high - low) * sample_sigmas(levels, scheme, shift, generator, **density)
        sigmas.append(drawn if levels == 1 else drawn[None])
        noise.append(sample_noise(latents[row : row + 1], generator))
    return torch.cat(sigmas), torch.cat(noise)


def spec_generators(part: Slice, seed: int, step: int) -> list[torch.Generator]:
    """One generator per row of `part` for the spec's own draws (`ModelSpec.forward`), on a key of its own per
    sample, so its draws neither depend on the layout nor move the sigmas' and noise's."""
    rows = part.tensors["latents"].shape[0]
    return [keyed_generator(seed, step, "spec", part.first_index + row) for row in range(rows)]


def draw_audio_sigmas(part: Slice, seed: int, step: int, scheme: str, shift: float, **density) -> torch.Tensor:
    """Each row's audio sigma (model.audio_timesteps = "independent"), from a generator on a key of its own per
    sample: the video's sigmas and noise are drawn exactly as with shared timesteps."""
    return torch.cat(
        [
            sample_sigmas(
                1, scheme, shift, keyed_generator(seed, step, "audio_sigma", part.first_index + row), **density
            )
            for row in range(part.tensors["latents"].shape[0])
        ]
    )


def draw_audio_noise(part: Slice, seed: int, step: int) -> torch.Tensor:
    """Noise like `audio_latents` for the rows of `part` (model.audio), one generator per sample on a key
    of its own, so the video's sigmas and noise are drawn exactly as without audio."""
    audio = part.tensors["audio_latents"]
    return torch.cat(
        [
            sample_noise(audio[row : row + 1], keyed_generator(seed, step, "audio", part.first_index + row))
            for row in range(audio.shape[0])
        ]
    )
