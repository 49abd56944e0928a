"""Log-mel spectrograms, the input of mel-spectrogram audio VAEs (LTX-2's), computed with torch alone.

Lightricks' LTX-2 code (ltx_core's AudioProcessor, used by its trainer's dataset preprocessing) builds it
with torchaudio's MelSpectrogram: a centered STFT with reflect padding and a periodic Hann window as long
as the FFT, magnitude (power 1), a Slaney-scale mel filterbank with Slaney (area) normalisation from 0 Hz
to half the sample rate, then log(max(x, 1e-5)). diffusers ships the audio VAE but not this front end
(its LTX-2 pipelines only decode), and torchaudio is not a dependency here, so the same arithmetic is
written out below; tests/shared/test_ltx2_audio.py checks its filterbank and scaling against the definitions
and against numbers from librosa (whose Slaney filters torchaudio reproduces).

Slaney's mel scale is linear below 1 kHz (3 mels per 200 Hz) and logarithmic above it (27 mels per
factor 6.4), so 1 kHz is mel 15 and 6.4 kHz mel 42.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_LINEAR_HZ = 200.0 / 3  # Hz per mel below the break
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _LINEAR_HZ  # 15
_LOG_STEP = math.log(6.4) / 27.0  # natural-log Hz per mel above the break
LOG_FLOOR = 1e-5


def hz_to_mel(hz: Tensor) -> Tensor:
    """Slaney mel of `hz` (float64 in, float64 out)."""
    linear = hz / _LINEAR_HZ
    log = _BREAK_MEL + torch.log(torch.clamp(hz, min=_BREAK_HZ) / _BREAK_HZ) / _LOG_STEP
    return torch.where(hz >= _BREAK_HZ, log, linear)


def mel_to_hz(mel: Tensor) -> Tensor:
    """Inverse of `hz_to_mel`."""
    linear = mel * _LINEAR_HZ
    log = _BREAK_HZ * torch.exp(_LOG_STEP * (mel - _BREAK_MEL))
    return torch.where(mel >= _BREAK_MEL, log, linear)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> Tensor:
    """(n_fft // 2 + 1, n_mels) float32: triangular filters evenly spaced in Slaney mels from 0 to
    sample_rate / 2, each scaled by 2 / its width in Hz (Slaney's area normalisation)."""
    bins = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)  # each STFT bin's frequency
    edges = mel_to_hz(
        torch.linspace(
            float(hz_to_mel(torch.tensor(0.0, dtype=torch.float64))),
            float(hz_to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64))),
            n_mels + 2,
            dtype=torch.float64,
        )
    )
    widths = edges[1:] - edges[:-1]
    offsets = edges[None, :] - bins[:, None]  # (bins, n_mels + 2): edge frequency minus bin frequency
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(rising, falling), min=0)
    return (filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]).float()


def log_mel(waveform: Tensor, sample_rate: int, n_fft: int, hop_length: int, n_mels: int) -> Tensor:
    """(B, C, S) waveform -> (B, C, frames, n_mels) float32 log-mel, frames = 1 + S // hop_length (centered
    STFT); computed in float32 on the waveform's device."""
    batch, channels, samples = waveform.shape
    flat = waveform.reshape(batch * channels, samples).float()
    window = torch.hann_window(n_fft, periodic=True, device=flat.device, dtype=flat.dtype)
    spectrum = torch.stft(
        flat,
        n_fft=n_fft,
        hop_length=hop_length,
        win_length=n_fft,
        window=window,
        center=True,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    ).abs()
    mel = torch.matmul(spectrum.transpose(1, 2), mel_filterbank(sample_rate, n_fft, n_mels).to(flat.device))
    return torch.log(torch.clamp(mel, min=LOG_FLOOR)).reshape(batch, channels, -1, n_mels)
