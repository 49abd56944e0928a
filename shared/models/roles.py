"""Optional capabilities of a family as members of its spec: present where the family has the capability,
None where it does not, rather than a flag plus hooks on the base that raise (issue 26's roles).

Callers test the member (`if spec.control_video:`, `if spec.sound:`) and use what it holds; a family declares one
with the functions that are particular to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.video_io import Sound


@dataclass(frozen=True)
class ControlVideo:
    """The family trains on a control video per sample (pose, depth, edges ...; `<key>.control.mp4` beside the
    clip): stage 1 decodes it at the clip's own frame times, sized and cropped as the clip (docs/processors.md),
    rejects a sample without one (`missing_control`), and hands it to `encode_video(..., control=)`; validation
    needs `validation.videos`, one control video per prompt. `pipeline_inputs(frames)`: the pipeline call's
    arguments for a control video of (F, H, W, 3) uint8 frames at the bucket's size (e.g. `video=` as a list of
    frames)."""

    pipeline_inputs: Callable[[np.ndarray], dict[str, Any]]


@dataclass(frozen=True)
class ImageConditions:
    """The family's i2v pipeline conditions on tokens a stage-1 image encoder makes of its image (Wan 2.1's CLIP,
    HunyuanVideo 1.5's SigLIP): stage 1 stores `encode(encoders, image)` of every validation image ((H, W, 3)
    uint8), the conditions as the pipeline's call takes them, so validation never loads that encoder."""

    encode: Callable[[dict[str, Any], np.ndarray], dict[str, Tensor]]


@dataclass(frozen=True)
class TextWithImage:
    """The family's text encoder reads each caption together with the clip's first frame (HunyuanVideo I2V's
    Llava: the image's tokens sit inside the prompt), so text conditions belong to a sample, not a caption: stage 1
    stores `encode(encoders, captions, frames)` per sample ((B, 3, H, W) first frames in [-1, 1]; the spec's
    `encode_text` then holds what the caption alone makes) and `encode_validation(encoders, prompt, image)` per
    validation (prompt, image) pair, as the pipeline's call takes them."""

    encode: Callable[[dict[str, Any], list[str], Tensor], dict[str, Tensor]]
    encode_validation: Callable[[dict[str, Any], str, np.ndarray], dict[str, Tensor]]


@dataclass(frozen=True)
class PerFrameNoise:
    """The transformer takes a noise level per latent frame, so `model.diffusion_forcing` trains it with
    `levels(latent_shape)` independent sigmas per sample of latents (C, F, H, W) (one per frame or causal block),
    all from the sample's keyed generator (train/parallel/batching.py); `forward` then gets sigmas (B, levels)."""

    levels: Callable[[tuple[int, ...]], int]


@dataclass(frozen=True)
class AudioFormat:
    """What a family's audio encoder takes: stage 1 resamples each clip's sound track to it."""

    sample_rate: int  # Hz
    channels: int  # 1 mono, 2 stereo


class SoundStream(ABC):
    """The family generates sound with the picture and can train it (`model.audio`; `ModelSpec.sound`, built with the
    spec from the family's `sound_stream` class): stage 1 loads `components` beside the video encoders, decodes each
    clip's sound over its sampled frames' time span at `format()` and stores `encode`'s tensors (`audio_latents`, of
    `latent_shape(bucket)`) beside the latents; the spec's `forward` returns the sound's terms in `Prediction.audio`;
    validation's video carries `output`'s track. `parameters` (a regular expression searched in parameter names) is
    what only the sound stream trains: frozen and refused as LoRA targets in a video-only run. `timestep_modes`: how
    its noise level may relate to the video's (`model.audio_timesteps`), the default first; `default_shift`: the
    independent audio sigmas' (None: flow.shift)."""

    components: ClassVar[tuple[str, ...]] = ("audio_vae",)
    parameters: ClassVar[str]
    timestep_modes: ClassVar[tuple[str, ...]] = ("shared",)

    def __init__(self, spec):
        self.spec = spec

    @property
    def default_shift(self) -> float | None:
        return None

    @abstractmethod
    def format(self) -> AudioFormat:
        """The rate and channels `encode` takes, from the audio encoder's config."""

    def samples(self, bucket: Bucket) -> int:
        """Audio samples of a clip of `bucket`: the frames' time span at the sampled frame rate."""
        return round(bucket.frames / self.spec.frame_rate * self.format().sample_rate)

    @abstractmethod
    def latent_shape(self, bucket: Bucket) -> tuple[int, ...]:
        """Per-sample shape of `audio_latents` for a clip of `bucket` (from configs alone)."""

    @abstractmethod
    def encode(self, encoders: dict[str, Any], audio: Tensor) -> dict[str, Tensor]:
        """{"audio_latents": (B, ...)} for `audio` (B, channels, samples(bucket)) float32 in [-1, 1] at
        `format().sample_rate`, from the loaded stage-1 components (`components`)."""

    @abstractmethod
    def output(self, pipeline, output) -> Sound:
        """The first sample's sound track from the pipeline's output."""
