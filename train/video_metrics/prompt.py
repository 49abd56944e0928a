"""Prompt adherence: how well the frames match the prompt in a CLIP or SigLIP embedding space.

The score is the cosine similarity of the prompt's text embedding with each sampled frame's image embedding,
averaged over the frames (`metrics.frames` of them, spread evenly from the first to the last): CLIPScore without its
rescaling (x 2.5, clipped at 0), so a SigLIP checkpoint reads on the same scale. In [-1, 1]; real CLIP checkpoints
give roughly 0.2 to 0.35 for matching pairs, so compare runs and steps of one checkpoint, not across checkpoints.
"""

from __future__ import annotations

import numpy as np

from vt.train.video_metrics.media import sample
from vt.train.video_metrics.models import Encoder


def prompt_score(encoder: Encoder, frames: np.ndarray, prompt: str, wanted: int) -> float:
    images = encoder.images(frames[sample(len(frames), wanted)])
    return float((images @ encoder.texts([prompt])[0]).mean())
