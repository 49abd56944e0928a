"""LTX-2's sound stream (`ltx2.py`): stereo log-mel spectrograms through its audio VAE, LTX2Pipeline's vocoder."""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.mel import log_mel
from vt.shared.models.roles import AudioFormat, SoundStream
from vt.shared.video_io import Sound

# The audio VAE's input: its STFT size is Lightricks' (ltx_core's AudioEncoder n_fft, the checkpoint's
# preprocessing.stft.filter_length); diffusers' AutoencoderKLLTX2Audio config does not carry it.
AUDIO_N_FFT = 1024
# The audio stream's and the audio <-> video cross-attention's parameters: no gradient reaches them without audio.
AUDIO_PARAMETERS = re.compile(r"(^|\.)(audio_|av_cross_attn_|video_to_audio|video_a2v_)|(^|\.)cross_attn_(audio_)?rope")


class LTX2Sound(SoundStream):
    parameters: ClassVar[str] = AUDIO_PARAMETERS.pattern
    # LTX2Pipeline steps both streams at one sigma; its transformer takes a timestep per stream
    timestep_modes: ClassVar[tuple[str, ...]] = ("shared", "independent")

    def format(self) -> AudioFormat:
        config = self.spec.load_config("audio_vae")
        return AudioFormat(sample_rate=config["sample_rate"], channels=config["in_channels"])

    def latent_shape(self, bucket: Bucket) -> tuple[int, int, int]:
        """(latent channels, frames, mel bins / 4): LTX2Pipeline's `audio_num_frames` for the clip's duration."""
        from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR as DOWN

        config = self.spec.load_config("audio_vae")
        per_second = config["sample_rate"] / config["mel_hop_length"] / float(DOWN)
        frames = round(bucket.frames / self.spec.frame_rate * per_second)
        return config["latent_channels"], frames, config["mel_bins"] // DOWN

    @torch.no_grad()
    def encode(self, encoders, audio: Tensor) -> dict[str, Tensor]:
        """The log-mel's posterior mode, cut to the pipeline's length, normalised as LTX2Pipeline denormalises."""
        from diffusers import LTX2Pipeline

        vae = encoders["audio_vae"]
        config = vae.config
        mel = log_mel(
            audio.to(vae.device, torch.float32), config.sample_rate, AUDIO_N_FFT, config.mel_hop_length, config.mel_bins
        )
        latents = vae.encode(mel.to(vae.dtype)).latent_dist.mode().float()
        frames = round(audio.shape[-1] / config.mel_hop_length / vae.temporal_compression_ratio)  # the duration's
        if latents.shape[2] < frames:
            raise ValueError(
                f"the LTX-2 audio VAE encoded {audio.shape[-1]} samples into {latents.shape[2]} latent "
                f"frames, fewer than the {frames} LTX2Pipeline generates for that duration"
            )
        latents = latents[:, :, :frames]
        packed = LTX2Pipeline._pack_audio_latents(latents)  # (B, frames, C x bins): the statistics' layout
        packed = LTX2Pipeline._normalize_audio_latents(packed, vae.latents_mean.float(), vae.latents_std.float())
        return {"audio_latents": LTX2Pipeline._unpack_audio_latents(packed, frames, latents.shape[3]).float()}

    def output(self, pipeline, output) -> Sound:
        """At the vocoder's rate (2.0: 24 kHz, 2.3 with bandwidth extension: 48 kHz)."""
        waveform = output.audio[0].float().cpu().numpy()
        return Sound(waveform.reshape(-1, waveform.shape[-1]), int(pipeline.vocoder.config.output_sampling_rate))
