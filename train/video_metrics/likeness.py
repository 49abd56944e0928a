"""Likeness to the training data and temporal consistency, from image embeddings (DINOv2, or CLIP's image tower).

- likeness: for each sampled frame of the render, the cosine similarity with the most similar frame among the
  reference clips' sampled frames, averaged over the render's frames. 1.0 when every sampled frame appears in a
  reference (a render equal to a training clip); a style or identity LoRA should raise it against `reference` while
  `reference_held_out` (clips of the same subject never trained on) tells learning from copying.
- consistency: the mean cosine similarity of each frame's embedding with the next frame's, over every frame: 1.0 for
  a still video, lower when the content jumps (flicker, morphing, a shuffled order).
"""

from __future__ import annotations

import torch


def likeness(frames: torch.Tensor, reference: torch.Tensor) -> float:
    """`frames` (N, D) and `reference` (M, D): unit embeddings."""
    return float((frames @ reference.T).max(dim=1).values.mean())


def consistency(frames: torch.Tensor) -> float | None:
    """`frames` (F, D) unit embeddings in playback order; None for a single frame (no pair)."""
    if len(frames) < 2:
        return None
    return float((frames[1:] * frames[:-1]).sum(dim=1).mean())
