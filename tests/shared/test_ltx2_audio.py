"""LTX-2's stage-1 audio encoder: the log-mel front end against its definition (torchaudio's MelSpectrogram
with Slaney mels, as Lightricks' AudioProcessor builds it), and `encode_audio` against LTX2Pipeline itself:
the stored audio latents have the shape the pipeline generates for the clip's duration, and the pipeline's
own decode path (denormalise, unpack, audio VAE, vocoder) gives back what the audio VAE makes of the sound
(tiny real models)."""

from __future__ import annotations

import math

import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.shared.models.mel import hz_to_mel, log_mel, mel_filterbank, mel_to_hz

BUCKET = Bucket(9, 32, 64)
RATE = 16000


def make_spec(folder, fps=8.0):
    return build_spec(ModelConfig(family="ltx-2", path=str(folder), max_text_tokens=16, audio=True), frame_rate=fps)


def tone(frequency: float, samples: int, amplitude: float = 0.5, rate: int = RATE) -> torch.Tensor:
    return amplitude * torch.sin(2 * math.pi * frequency * torch.arange(samples, dtype=torch.float64) / rate)


def test_slaney_mel_scale_and_filterbank_follow_their_definitions():
    """1 kHz is mel 15 and 6.4 kHz mel 42 (linear below 1 kHz, 27 mels per factor 6.4 above); each filter is a
    triangle peaking at its centre frequency whose area in Hz is 1 (Slaney's normalisation)."""
    hz = torch.tensor([0.0, 200.0, 1000.0, 6400.0, 8000.0], dtype=torch.float64)
    torch.testing.assert_close(hz_to_mel(hz), torch.tensor([0.0, 3.0, 15.0, 42.0, 15 + 27 * math.log(8) / math.log(6.4)],
                                                           dtype=torch.float64))
    torch.testing.assert_close(mel_to_hz(hz_to_mel(hz)), hz)
    n_fft, n_mels = 1024, 64
    bank = mel_filterbank(RATE, n_fft, n_mels).double()
    assert bank.shape == (n_fft // 2 + 1, n_mels) and bank.min() >= 0
    step = RATE / n_fft  # Hz per STFT bin
    centres = mel_to_hz(torch.linspace(0, float(hz_to_mel(torch.tensor(RATE / 2.0))), n_mels + 2,
                                       dtype=torch.float64))[1:-1]
    assert (bank.argmax(0).double() * step - centres).abs().max() < step  # one of the two bins around its centre
    wide = (centres > 400)  # filters spanning many bins: the bin sum approximates the area
    torch.testing.assert_close(bank.sum(0)[wide] * step, torch.ones(int(wide.sum()), dtype=torch.float64),
                               atol=0.03, rtol=0)


def test_log_mel_of_a_tone_is_its_stft_magnitude_through_the_filters():
    """A sine on an STFT bin, amplitude A: a periodic Hann window of n_fft gives A n_fft / 4 on its bin and
    half that on each neighbour (magnitude, no normalisation, power 1), so the log-mel of every full frame is
    log of those through the filterbank; frames are 1 + samples // hop (a centred STFT); stereo stays two
    channels."""
    n_fft, hop, n_mels, amplitude = 1024, 160, 64, 0.5
    bin_ = 64  # 1 kHz
    wave = tone(bin_ * RATE / n_fft, 16000, amplitude)
    stereo = torch.stack([wave, 0.5 * wave])[None].float()
    mel = log_mel(stereo, RATE, n_fft, hop, n_mels)
    assert mel.shape == (1, 2, 1 + 16000 // hop, n_mels) and mel.dtype == torch.float32
    bank = mel_filterbank(RATE, n_fft, n_mels).double()
    peak = amplitude * n_fft / 4
    expected = torch.log(torch.clamp(peak * (bank[bin_] + 0.5 * bank[bin_ - 1] + 0.5 * bank[bin_ + 1]), min=1e-5))
    inner = mel[0, 0, 10:-10].double()  # frames whose window lies inside the signal
    torch.testing.assert_close(inner, expected.expand_as(inner), atol=2e-3, rtol=0)
    torch.testing.assert_close(mel[0, 1, 10:-10].double(), torch.log(torch.clamp(
        0.5 * torch.exp(expected), min=1e-5)).expand_as(inner), atol=2e-3, rtol=0)
    silence = log_mel(torch.zeros(1, 1, 3200), RATE, n_fft, hop, n_mels)
    assert torch.equal(silence, torch.full_like(silence, math.log(1e-5)))


def test_audio_latents_have_the_pipelines_shape_and_decode_through_its_own_path(tiny_model_factory):
    """`audio_format` is the audio VAE's (16 kHz stereo); the stored latents of a bucket's sound have
    `audio_latent_shape`, which is what LTX2Pipeline itself generates for that many frames at that rate
    (its `output_type="latent"` audio); denormalised by the pipeline's own function they are the audio VAE's
    posterior mode of the log-mel, and the pipeline's decode path (audio VAE, vocoder) makes a finite stereo
    waveform of them."""
    from diffusers import LTX2Pipeline

    folder = tiny_model_factory("ltx-2")
    spec = make_spec(folder)
    fmt = spec.audio_format()
    assert (fmt.sample_rate, fmt.channels) == (RATE, 2)
    samples = spec.audio_samples(BUCKET)
    assert samples == round(9 / 8 * RATE) == 18000
    shape = spec.audio_latent_shape(BUCKET)
    assert spec.condition_shapes(BUCKET)["audio_latents"] == shape == (2, 28, 2)  # 1.125 s x 25 latents a second

    encoders = spec.load_stage1()
    assert "audio_vae" in encoders
    sound = torch.stack([torch.stack([tone(440, samples), tone(660, samples)]),
                         torch.stack([tone(880, samples), tone(880, samples)])]).float()
    stored = spec.encode_audio(encoders, sound)["audio_latents"]
    assert stored.shape == (2, *shape) and stored.dtype == torch.float32 and stored.isfinite().all()
    assert not torch.allclose(stored[0], stored[1], atol=1e-3)  # the sound is what is encoded

    pipeline = spec.build_pipeline(spec.load_transformer(), **spec.load_stage1())
    out = pipeline(**spec.pipeline_inputs("a tone", BUCKET, steps=2, seed=0), guidance_scale=1.0, stg_scale=0.0,
                   modality_scale=1.0, audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
                   output_type="latent")
    assert tuple(out.audio.shape[1:]) == shape  # what the pipeline generates for 9 frames at 8 fps

    vae = encoders["audio_vae"]
    mean, std = vae.latents_mean, vae.latents_std
    assert not torch.allclose(mean, torch.zeros_like(mean))  # the preset's statistics are not the identity
    packed = LTX2Pipeline._denormalize_audio_latents(LTX2Pipeline._pack_audio_latents(stored), mean, std)
    raw = LTX2Pipeline._unpack_audio_latents(packed, shape[1], shape[2])
    mel = log_mel(sound, RATE, 1024, vae.config.mel_hop_length, vae.config.mel_bins)
    mode = vae.encode(mel).latent_dist.mode()
    torch.testing.assert_close(raw, mode[:, :, :shape[1]], atol=1e-5, rtol=1e-5)
    waveform = pipeline.vocoder(vae.decode(raw).sample)
    assert waveform.shape[:2] == (2, 2) and waveform.shape[2] > 0 and waveform.isfinite().all()
