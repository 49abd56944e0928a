"""The clip's own frames a run conditions on (`model.task`): i2v its first frame, flf2v its first and last, t2v none.

`ModelSpec.frame_conditions` holds a `FrameConditions` where the task conditions on frames and None for t2v, as the
optional roles of roles.py: a family asks it which frames stage 1 encodes as conditions (`frames`), whether the
last frame is one (`last`), what its forward needs from the batch (`require`), and validation which images the
pipeline takes (`image_arguments`), rather than comparing task names. This module and shared/config.py are the only
readers of `model.task` (tests/test_architecture.py); `task_of` is the name the family tables are keyed by
(`pipelines`, `task_components`, tiny presets) and the one shard provenance records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from vt.shared.errors import UserError


def task_of(config) -> str:
    """`model.task` of a ModelConfig: "t2v", "i2v" or "flf2v"."""
    return config.task


@dataclass(frozen=True)
class FrameConditions:
    """The frames of a clip its task conditions on: the first, and for flf2v also the last."""

    name: str  # the task: "i2v" or "flf2v"

    @classmethod
    def of(cls, config) -> FrameConditions | None:
        """The conditions of a ModelConfig's task; None for t2v."""
        return None if task_of(config) == "t2v" else cls(task_of(config))

    @property
    def last(self) -> bool:
        """Whether the clip's last frame is a condition too (flf2v)."""
        return self.name == "flf2v"

    @property
    def described(self) -> str:
        return "first and last frames" if self.last else "first frame"

    def frames(self, video: Tensor) -> list[Tensor]:
        """The condition frames of `video` (B, C, F, H, W), each (B, C, 1, H, W): [first] or [first, last]."""
        return [video[:, :, :1], video[:, :, -1:]] if self.last else [video[:, :, :1]]

    def first(self, video: Tensor) -> Tensor:
        """The first frame of `video` (B, C, F, H, W), (B, C, 1, H, W): what an i2v family encodes alone."""
        return self.frames(video)[0]

    @staticmethod
    def frame_shape(latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one frame encoded alone, (C, 1, H, W), for latents of `latent_shape` (C, F, H, W)."""
        return (latent_shape[0], 1, *latent_shape[2:])

    def require(self, batch: dict[str, Tensor], *names: str, what: str = "") -> None:
        """KeyError naming the task and how to store them, unless `batch` holds every one of `names` (`what`: how
        the message names them, default `batch[names]`)."""
        if any(name not in batch for name in names):
            raise KeyError(
                f"task {self.name} needs {what or f'batch{[*names]}'}; precompute the shards with "
                f'model.task = "{self.name}"'
            )


# Image call arguments of the tasks that condition on frames: (tasks that take it, its name in errors, the frame it
# is, the config key giving it, its name when refused, the task to set instead, what it is for).
IMAGE_ARGUMENTS = {
    "image": (
        ("i2v", "flf2v"),
        "an image",
        "first frame",
        "validation.images",
        "image",
        "i2v",
        "first-frame conditioning",
    ),
    "last_image": (
        ("flf2v",),
        "a last_image",
        "last frame",
        "validation.last_images",
        "last image",
        "flf2v",
        "first-and-last-frame conditioning",
    ),
}


def image_arguments(config, family: str, image=None, last_image=None) -> dict[str, Any]:
    """The pipeline call's `image=` (i2v, flf2v) and `last_image=` (flf2v) for a ModelConfig's task, as given (the
    caller converts them); UserError for one the task needs and lacks, or one it takes not."""
    task, out = task_of(config), {}
    for name, value in (("image", image), ("last_image", last_image)):
        tasks, noun, frame, key, shown, wanted, purpose = IMAGE_ARGUMENTS[name]
        if task in tasks:
            if value is None:
                raise UserError(
                    f"{family} {task} generation needs {noun} (PIL or (H, W, 3) uint8) for the "
                    f"{frame}; set {key}, one per validation prompt"
                )
            out[name] = value
        elif value is not None:
            raise UserError(f'{family} with task {task!r} takes no {shown}; use model.task = "{wanted}" for {purpose}')
    return out
