"""Kandinsky 6's sound stream (`kandinsky6.py`): the mono track through MMAudio's mel VAE, its BigVGAN vocoder's
waveform."""

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

# What only the sound stream trains: its embeddings, text blocks, decoder halves and cross-stream attentions.
AUDIO_PARAMETERS = re.compile(r"(^|\.)(audio_|va_|av_)")


class Kandinsky6Sound(SoundStream):
    parameters: ClassVar[str] = AUDIO_PARAMETERS.pattern  # one timestep for both streams in diffusers' class

    def format(self) -> AudioFormat:
        return AudioFormat(sample_rate=int(self.spec.load_config("audio_vae")["sample_rate"]), channels=1)

    def hop(self) -> int:
        """Waveform samples per audio latent: two mel hops (MMAudioVAE's `latent_hop_length`)."""
        return 2 * int(self.spec.load_config("audio_vae")["hop_length"])

    def latent_shape(self, bucket: Bucket) -> tuple[int, int]:
        """(latent channels, N): the pipeline's audio length for `bucket.frames` at the spec's frame rate."""
        self.spec.check_bucket(bucket)
        config = self.spec.load_config("audio_vae")
        return (
            config["latent_channels"],
            math.ceil(bucket.frames / self.spec.frame_rate * config["sample_rate"] / self.hop()),
        )

    @torch.no_grad()
    def encode(self, encoders, audio: Tensor) -> dict[str, Tensor]:
        """Each mono track padded with silence to whole latent hops, MMAudioVAE's posterior mode x scaling_factor."""
        if audio.ndim != 3 or audio.shape[1] != 1:
            raise ValueError(f"audio must be (B, 1, samples) in [-1, 1], got shape {tuple(audio.shape)}")
        vae = encoders["audio_vae"]
        frames = math.ceil(audio.shape[-1] / self.hop())
        waveform = torch.nn.functional.pad(audio[:, 0].float(), (0, frames * self.hop() - audio.shape[-1]))
        latents = vae.encode(waveform.to(vae.device, vae.dtype)).latent_dist.mode().float()
        return {"audio_latents": (latents[:, :, :frames] * vae.config.scaling_factor).cpu()}

    def output(self, pipeline, output) -> Sound:
        waveform = np.ascontiguousarray(output.audio[0], dtype=np.float32)  # output_type "np": numpy already
        return Sound(waveform.reshape(1, -1).clip(-1, 1), int(pipeline.audio_sample_rate))
