"""What the chain hands the encoder process: a sample fitted to its bucket, as uint8 pixels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vt.shared.buckets import Bucket

from .fit_bucket import to_model_range


@dataclass
class PreparedSample:
    """A sample fitted to its bucket, as uint8 `pixels` (3, F, H, W).

    uint8 is a quarter of float32's bytes to send from a decode worker and to hold in a bucket's
    buffer until the shard is full; `video`, the encoder's input, is made from it when asked for.
    `control_pixels`: the control video's frames, aligned with `pixels` (families that train on one).
    `sound`: (channels, samples) float32 in [-1, 1], the clip's sound over the frames' time span at the
    family's rate (model.audio; sound.py), None otherwise. `clip`: a manifest's record of the clip (its uri,
    span and metadata), stored with the sample in its shard; None for samples from tars and folders.
    `wants_caption`: `caption_model` asked for the model's caption (made in the service, before the text phase).
    """

    key: str
    caption: str
    bucket: Bucket
    pixels: torch.Tensor
    control_pixels: torch.Tensor | None = None
    sound: torch.Tensor | None = None
    clip: dict | None = None
    wants_caption: bool = False  # caption_model: captioned by the model in the service (captioner.py)
    extra_captions: tuple[str, ...] = ()  # more captions of it; the trainer draws one of all of them per epoch

    @property
    def captions(self) -> list[str]:
        """Every caption of it, the first `caption`, each once."""
        return list(dict.fromkeys((self.caption, *self.extra_captions)))

    @property
    def video(self) -> torch.Tensor:
        """(3, F, H, W) float32 in [-1, 1] (a new tensor each time)."""
        return to_model_range(self.pixels)

    @property
    def first_frame(self) -> torch.Tensor:
        """(3, 1, H, W): `video`'s first frame, made from that frame alone."""
        return to_model_range(self.pixels[:, :1])

    @property
    def control(self) -> torch.Tensor | None:
        """The control video as `video` is made, (3, F, H, W) float32 in [-1, 1]; None without one."""
        return None if self.control_pixels is None else to_model_range(self.control_pixels)
