"""The sound of a validation video (families with sound, model.audio): its agreement with the prompt and its offset.

- audio_prompt: the cosine similarity of a CLAP checkpoint's embedding of the track (mixed to mono, resampled to
  the checkpoint's rate: 48 kHz for LAION's) with its embedding of the prompt, in [-1, 1].
- av_offset_ms: how late the sound's onsets come after the picture's changes. Both are taken per video frame t =
  1 .. F-1: the picture's change (mean absolute luma difference from frame t-1, motion.change_energy) and the sound's
  onset (the rise of its RMS over the frame's span [t/fps, (t+1)/fps) from the span before; falls count 0). Each is
  standardized, and their cross-correlation is taken at lags of up to 1 s (at most half the clip); the lag of the
  highest (the smallest such lag on a tie) times 1000 / fps is the offset: positive when the sound comes late, in
  steps of one frame (125 ms at 8 fps). Undefined, and not logged, when either signal is flat: a silent track or a
  still picture.
"""

from __future__ import annotations

import numpy as np

from vt.shared.video_io import Sound
from vt.train.video_metrics.models import Encoder
from vt.train.video_metrics.motion import change_energy

MAX_LAG_S = 1.0


def mono(sound: Sound) -> np.ndarray:
    return sound.waveform.astype(np.float32).mean(axis=0)


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling (the spectrum cut or zero-padded); a metric's input, not a listening copy."""
    if rate == target or not len(wave):
        return wave
    length = max(1, round(len(wave) * target / rate))
    spectrum = np.fft.rfft(wave)
    out = np.zeros(length // 2 + 1, dtype=spectrum.dtype)
    keep = min(len(spectrum), len(out))
    out[:keep] = spectrum[:keep]
    return (np.fft.irfft(out, length) * (length / len(wave))).astype(np.float32)


def audio_prompt(encoder: Encoder, sound: Sound, prompt: str) -> float:
    wave = resample(mono(sound), sound.sample_rate, encoder.sample_rate)
    return float(encoder.sounds([wave])[0] @ encoder.texts([prompt])[0])


def onset_envelope(sound: Sound, fps: float, frames: int) -> np.ndarray:
    """The sound's onset arriving at each video frame t = 1 .. frames-1 (see the module's docstring)."""
    wave, rate = mono(sound), sound.sample_rate
    edges = np.round(np.arange(frames + 1) * rate / fps).astype(int)
    rms = np.array(
        [np.sqrt(np.mean(np.square(wave[a:b]))) if b > a and a < len(wave) else 0.0 for a, b in zip(edges, edges[1:])]
    )
    return np.maximum(np.diff(rms), 0.0)


def _flat(signal: np.ndarray) -> bool:
    return len(signal) < 2 or float(np.ptp(signal)) <= 1e-6


def av_offset_ms(frames: np.ndarray, sound: Sound, fps: float) -> float | None:
    picture, heard = change_energy(frames), onset_envelope(sound, fps, len(frames))
    if _flat(picture) or _flat(heard):
        return None
    picture = (picture - picture.mean()) / picture.std()
    heard = (heard - heard.mean()) / heard.std()
    reach = min(round(MAX_LAG_S * fps), len(picture) // 2)
    lags = np.arange(-reach, reach + 1)
    scores = np.array(
        [
            np.dot(picture[max(0, -lag) : len(picture) - max(0, lag)], heard[max(0, lag) : len(heard) - max(0, -lag)])
            for lag in lags
        ]
    )
    best = lags[scores >= scores.max() - 1e-9 * max(1.0, abs(scores.max()))]
    return float(best[np.argmin(np.abs(best))] * 1000 / fps)
