"""LTX-2's stage-1 audio encoder: the log-mel front end against its definition (torchaudio's MelSpectrogram
with Slaney mels, as Lightricks' AudioProcessor builds it) and against numbers from librosa, and `sound.encode` against LTX2Pipeline itself:
the stored audio latents have the shape the pipeline generates for the clip's duration, and the pipeline's
own decode path (denormalise, unpack, audio VAE, vocoder) gives back what the audio VAE makes of the sound
(tiny real models)."""

from __future__ import annotations

import math

import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.mel import hz_to_mel, log_mel, mel_filterbank, mel_to_hz
from vt.shared.models import build_spec

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
    torch.testing.assert_close(
        hz_to_mel(hz), torch.tensor([0.0, 3.0, 15.0, 42.0, 15 + 27 * math.log(8) / math.log(6.4)], dtype=torch.float64)
    )
    torch.testing.assert_close(mel_to_hz(hz_to_mel(hz)), hz)
    n_fft, n_mels = 1024, 64
    bank = mel_filterbank(RATE, n_fft, n_mels).double()
    assert bank.shape == (n_fft // 2 + 1, n_mels) and bank.min() >= 0
    step = RATE / n_fft  # Hz per STFT bin
    centres = mel_to_hz(torch.linspace(0, float(hz_to_mel(torch.tensor(RATE / 2.0))), n_mels + 2, dtype=torch.float64))[
        1:-1
    ]
    assert (bank.argmax(0).double() * step - centres).abs().max() < step  # one of the two bins around its centre
    wide = centres > 400  # filters spanning many bins: the bin sum approximates the area
    torch.testing.assert_close(
        bank.sum(0)[wide] * step, torch.ones(int(wide.sum()), dtype=torch.float64), atol=0.03, rtol=0
    )


# librosa 0.11's mel filters (htk=False, norm="slaney": torchaudio's mel_scale / norm "slaney" are the same) and
# log(max(mel @ |stft|, 1e-5)) of 0.3 sin(440 Hz) + 0.1 sin(3100 Hz), 18000 samples at 16 kHz (n_fft 1024, hop 160,
# periodic Hann, centred, reflect padding), computed once outside the suite (librosa is not a dependency).
LIBROSA_PEAK_BINS = [21, 43, 64, 91, 129, 182, 257, 362]
LIBROSA_PEAKS = [0.00292115, 0.00296892, 0.00261983, 0.00199282, 0.00139908, 0.000993727, 0.000704303, 0.00049915]
LIBROSA_FRAMES = {
    0: [-0.280174, -0.986958, -3.09019, -4.45224, -4.66967, -2.17107, -3.25396, -4.75947],
    50: [-1.12166, -1.91322, -10.6677, -11.5129, -11.5129, -3.16993, -4.75252, -11.5129],
    112: [-0.293029, -0.974535, -2.89239, -3.64185, -4.06316, -2.6745, -4.24075, -8.40525],
}


def test_log_mel_matches_librosas_slaney_mel_spectrogram():
    """The 8-mel filterbank of the tiny preset peaks where librosa's does, as high; the log-mel of two tones
    matches librosa's at the first frame, one inside and the last (the centred, reflect-padded edges)."""
    bank = mel_filterbank(RATE, 1024, 8)
    assert bank.argmax(0).tolist() == LIBROSA_PEAK_BINS
    torch.testing.assert_close(
        bank.max(0).values.double(), torch.tensor(LIBROSA_PEAKS, dtype=torch.float64), atol=0, rtol=1e-5
    )
    wave = (tone(440, 18000, 0.3) + tone(3100, 18000, 0.1)).float()
    mel = log_mel(wave[None, None], RATE, 1024, 160, 8)[0, 0]
    assert mel.shape == (113, 8)
    for frame, expected in LIBROSA_FRAMES.items():
        expected = torch.tensor(expected)
        loud = expected > -9  # near the floor, float32 rounding of a tiny magnitude moves the log
        torch.testing.assert_close(mel[frame][loud], expected[loud], atol=1e-4, rtol=0)
        assert (mel[frame][~loud] < -9).all()


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
    torch.testing.assert_close(
        mel[0, 1, 10:-10].double(),
        torch.log(torch.clamp(0.5 * torch.exp(expected), min=1e-5)).expand_as(inner),
        atol=2e-3,
        rtol=0,
    )
    silence = log_mel(torch.zeros(1, 1, 3200), RATE, n_fft, hop, n_mels)
    assert torch.equal(silence, torch.full_like(silence, math.log(1e-5)))


def test_audio_latents_have_the_pipelines_shape_and_decode_through_its_own_path(tiny_model_factory):
    """`sound.format()` is the audio VAE's (16 kHz stereo); the stored latents of a bucket's sound have
    `sound.latent_shape`, which is what LTX2Pipeline itself generates for that many frames at that rate
    (its `output_type="latent"` audio); denormalised by the pipeline's own function they are the audio VAE's
    posterior mode of the log-mel, and the pipeline's decode path (audio VAE, vocoder) makes a finite stereo
    waveform of them."""
    from diffusers import LTX2Pipeline

    folder = tiny_model_factory("ltx-2")
    spec = make_spec(folder)
    fmt = spec.sound.format()
    assert (fmt.sample_rate, fmt.channels) == (RATE, 2)
    samples = spec.sound.samples(BUCKET)
    assert samples == round(9 / 8 * RATE) == 18000
    shape = spec.sound.latent_shape(BUCKET)
    assert spec.condition_shapes(BUCKET)["audio_latents"] == shape == (2, 28, 2)  # 1.125 s x 25 latents a second

    encoders = spec.load_stage1()
    assert "audio_vae" in encoders
    sound = torch.stack(
        [torch.stack([tone(440, samples), tone(660, samples)]), torch.stack([tone(880, samples), tone(880, samples)])]
    ).float()
    stored = spec.sound.encode(encoders, sound)["audio_latents"]
    assert stored.shape == (2, *shape) and stored.dtype == torch.float32 and stored.isfinite().all()
    assert not torch.allclose(stored[0], stored[1], atol=1e-3)  # the sound is what is encoded

    pipeline = spec.build_pipeline(spec.load_transformer(), **spec.load_stage1())
    out = pipeline(
        **spec.pipeline_inputs("a tone", BUCKET, steps=2, seed=0),
        guidance_scale=1.0,
        stg_scale=0.0,
        modality_scale=1.0,
        audio_guidance_scale=1.0,
        audio_stg_scale=0.0,
        audio_modality_scale=1.0,
        output_type="latent",
    )
    assert tuple(out.audio.shape[1:]) == shape  # what the pipeline generates for 9 frames at 8 fps

    vae = encoders["audio_vae"]
    mean, std = vae.latents_mean, vae.latents_std
    assert not torch.allclose(mean, torch.zeros_like(mean))  # the preset's statistics are not the identity
    packed = LTX2Pipeline._denormalize_audio_latents(LTX2Pipeline._pack_audio_latents(stored), mean, std)
    raw = LTX2Pipeline._unpack_audio_latents(packed, shape[1], shape[2])
    mel = log_mel(sound, RATE, 1024, vae.config.mel_hop_length, vae.config.mel_bins)
    mode = vae.encode(mel).latent_dist.mode()
    torch.testing.assert_close(raw, mode[:, :, : shape[1]], atol=1e-5, rtol=1e-5)
    waveform = pipeline.vocoder(vae.decode(raw).sample)
    assert waveform.shape[:2] == (2, 2) and waveform.shape[2] > 0 and waveform.isfinite().all()


def test_real_audio_vae_config_gives_the_pipelines_length(tiny_model_factory, tmp_path):
    """At LTX-2's real audio VAE config (scripts/real_models.json: 16 kHz stereo, 64 mels, x4 in time and mel
    bins, 8 latent channels; random weights) a 25-frame clip at 24 fps is stored as (8, 26, 16): the
    pipeline's round(25 / 24 x 25), one latent frame fewer than the causal encoder makes of it; 121 frames
    (LTX-2's default) give 126."""
    import json
    import shutil
    from pathlib import Path

    from diffusers import AutoencoderKLLTX2Audio

    real = json.loads((Path(__file__).parents[2] / "scripts" / "real_models.json").read_text())["ltx2"]
    config = real["components"]["audio_vae"]["config"]
    folder = tmp_path / "ltx-2"
    shutil.copytree(tiny_model_factory("ltx-2"), folder)
    saved = json.loads((folder / "audio_vae" / "config.json").read_text())
    (folder / "audio_vae" / "config.json").write_text(json.dumps({**saved, **config}))
    spec = make_spec(folder, fps=24.0)
    bucket = Bucket(25, 512, 768)
    assert (spec.sound.format().sample_rate, spec.sound.format().channels) == (16000, 2)
    shape = spec.sound.latent_shape(bucket)
    assert shape == (8, 26, 16) and spec.sound.latent_shape(Bucket(121, 512, 768)) == (8, 126, 16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        vae = AutoencoderKLLTX2Audio(**config).eval()
    encoded = []
    vae.encoder.register_forward_hook(lambda module, args, out: encoded.append(tuple(out.shape)))
    sound = tone(440, spec.sound.samples(bucket)).float().expand(1, 2, -1)
    stored = spec.sound.encode({"audio_vae": vae}, sound)["audio_latents"]
    assert stored.shape == (1, *shape) and stored.isfinite().all()
    assert encoded == [(1, 2 * 8, 27, 16)]  # mean and log-variance of the causal encoder's 27 frames: one more
