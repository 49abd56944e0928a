"""Validation videos during training: the family's own diffusers pipeline around the live transformer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import Config
from vt.shared.log import get_logger
from vt.shared.models.spec import ModelSpec
from vt.shared.video_io import write_video

log = get_logger("vt.train.validation")


def load_image(path: str) -> np.ndarray:
    """An image file -> (H, W, 3) uint8 (PyAV reads PNG/JPEG as one-frame videos)."""
    import av

    with av.open(path) as container:
        frame = next(container.decode(video=0))
        return frame.to_ndarray(format="rgb24")


class Validator:
    def __init__(self, spec: ModelSpec, config: Config, bucket: Bucket, device: str,
                 autocast: torch.dtype | None = None):
        """`autocast`: the dtype to run the pipeline in when its parts differ (a trained float32
        transformer beside bfloat16 text encoder and VAE); None runs it as loaded."""
        self.spec = spec
        self.autocast = autocast
        self.config = config
        self.bucket = bucket
        self.device = device
        self.prompts = config.train.validation_prompts
        self.images = [load_image(p) for p in config.train.validation_images]
        if self.prompts and config.model.task == "i2v" and len(self.images) != len(self.prompts):
            raise ValueError(f"model.task = 'i2v' needs one train.validation_images entry per validation prompt "
                             f"({len(self.prompts)} prompts, {len(self.images)} images)")
        self._pipeline = None

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    def run(self, transformer, step: int) -> list[Path]:
        if not self.enabled:
            return []
        if self._pipeline is None:
            self._pipeline = self.spec.build_pipeline(transformer, device=self.device)
        out_dir = self.config.run_dir / "validation" / f"step-{step:06d}"
        was_training = transformer.training
        transformer.eval()
        paths = []
        try:
            for i, prompt in enumerate(self.prompts):
                image = self.images[i] if self.images else None
                with torch.autocast(torch.device(self.device).type, dtype=self.autocast or torch.float32,
                                    enabled=self.autocast is not None):
                    frames = self.spec.generate(self._pipeline, prompt, self.bucket,
                                                self.config.train.validation_steps,
                                                seed=self.config.train.seed + i, image=image)
                paths.append(write_video(frames, out_dir / f"{i:02d}.mp4", fps=self.config.buckets.fps))
        finally:
            transformer.train(was_training)
        log.info("validation step %d: %d videos in %s", step, len(paths), out_dir)
        return paths
