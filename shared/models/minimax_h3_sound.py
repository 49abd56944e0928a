"""MiniMax H3's sound stream (`minimax_h3.py`): each stereo channel through the mono audio VAE, the modular
pipeline's track."""

from __future__ import annotations

import math
import re
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.models.roles import AudioFormat, SoundStream
from vt.shared.video_io import Sound

# The audio stream's own parameters: without `model.audio` no gradient reaches them.
AUDIO_PARAMETERS = re.compile(r"(^|\.)audio_proj_(in|out)\b")
STEREO = 2  # MiniMaxH3ModularPipeline.audio_channels: stereo rows, channel-major


class MiniMaxH3Sound(SoundStream):
    parameters: ClassVar[str] = AUDIO_PARAMETERS.pattern
    # The pipeline pairs the streams' sigmas through their schedules; its rows take a timestep each
    timestep_modes: ClassVar[tuple[str, ...]] = ("shared", "independent")

    @property
    def default_shift(self) -> float:
        """Independent audio sigmas' shift: the audio scheduler's (3 in the release; the video's: 12)."""
        return self.spec.schedule_shifts[1]

    def format(self) -> AudioFormat:
        return AudioFormat(sample_rate=int(self.spec.load_config("audio_vae")["sampling_rate"]), channels=STEREO)

    def latent_shape(self, bucket: Bucket) -> tuple[int, ...]:
        """(2 stereo channels, latent channels, N): the VAE pads the waveform to whole hops."""
        self.spec.check_bucket(bucket)
        config = self.spec.load_config("audio_vae")
        return STEREO, config["latent_channels"], math.ceil(self.samples(bucket) / math.prod(config["encoder_rates"]))

    @torch.no_grad()
    def encode(self, encoders, audio: Tensor) -> dict[str, Tensor]:
        """(B, 2, C, N): each channel's posterior mode, normalised as the pipeline's audio decode step denormalises."""
        if audio.ndim != 3 or audio.shape[1] != STEREO:
            raise ValueError(f"audio must be (B, {STEREO}, samples) in [-1, 1], got shape {tuple(audio.shape)}")
        vae = encoders["audio_vae"]
        batch, channels, samples = audio.shape
        mono = audio.reshape(batch * channels, 1, samples).to(vae.device, torch.float32)
        latents = vae.encode(mono).latent_dist.mode().float()
        mean, std = (
            torch.tensor(vae.config[k], device=latents.device).view(1, -1, 1) for k in ("latents_mean", "latents_std")
        )
        latents = (latents - mean) / std
        return {"audio_latents": latents.reshape(batch, channels, *latents.shape[1:]).cpu()}

    def output(self, pipeline, output) -> Sound:
        return Sound(np.ascontiguousarray(output.audio[0].float().cpu().numpy()).clip(-1, 1), int(output.sampling_rate))
