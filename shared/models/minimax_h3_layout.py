"""MiniMax H3's packed t2va sequence (text, video and stereo-audio rows in one sequence, as its modular pipeline lays
them out): shared by the spec's `forward` and the pipeline handle (minimax_h3_pipeline.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from vt.shared.models.minimax_h3_sound import STEREO


def pipeline_constants():
    from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as h3

    return h3


def packed_layout(text_rows: int, latent_shape: tuple[int, ...], audio_latents: int, patch: tuple[int, int, int]):
    """The pipeline's t2va layout (`MiniMaxH3PrepareLayoutStep.build_packed_sequence`) of one sample: position_ids,
    token_tags, video_indices, audio_indices, text_indices."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    h3 = pipeline_constants()
    _, frames, height, width = latent_shape
    return MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((text_rows,), h3.MINIMAX_H3_TEXT_TAG, dtype=torch.long),
        frames,
        height,
        width,
        audio_latents,
        patch,
        STEREO,
        h3.MINIMAX_H3_AUDIO_TAG,
        h3.MINIMAX_H3_VIDEO_TAG,
    )[:5]


def normalise_pixels(video: Tensor) -> Tensor:
    """[-1, 1] pixels as the H3 video VAE takes them: [0, 1], then ImageNet's mean and std (the pipeline's)."""
    pipeline = pipeline_constants().MiniMaxH3ModularPipeline
    mean, std = (
        torch.tensor(v.fget(None), device=video.device).view(1, -1, 1, 1, 1)
        for v in (pipeline.pixel_mean, pipeline.pixel_std)
    )
    return ((video + 1) / 2 - mean) / std


def unpatchify(rows: Tensor, latent_shape: tuple[int, ...], patch: tuple[int, int, int]) -> Tensor:
    """(rows, C x p) -> (C, F, H, W): MiniMaxH3AfterDenoiseStep's inverse of the patchify."""
    channels, frames, height, width = latent_shape
    pt, ph, pw = patch
    x = rows.reshape(frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return x.permute(3, 0, 4, 1, 5, 2, 6).reshape(channels, frames, height, width)


class TextTokenTypes:
    """Qwen3VLProcessor's `create_mm_token_type_ids` for text without vision tokens (t2va): all 0 (text). It stands in
    for the processor, which the t2va presentation uses for nothing else and which needs torchvision to load."""

    @staticmethod
    def create_mm_token_type_ids(input_ids: list) -> list[list[int]]:
        return [[0] * len(ids) for ids in input_ids]
