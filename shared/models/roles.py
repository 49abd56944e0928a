"""Optional capabilities of a family as members of its spec: present where the family has the capability,
None where it does not, rather than a flag plus hooks on the base that raise (issue 26's roles).

Callers test the member (`if spec.control_video:`) and use what it holds; a family declares one with the
functions that are particular to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ControlVideo:
    """The family trains on a control video per sample (pose, depth, edges ...; `<key>.control.mp4` beside the
    clip): stage 1 decodes it at the clip's own frame times, sized and cropped as the clip (docs/processors.md),
    rejects a sample without one (`missing_control`), and hands it to `encode_video(..., control=)`; validation
    needs `train.validation_videos`, one control video per prompt. `pipeline_inputs(frames)`: the pipeline call's
    arguments for a control video of (F, H, W, 3) uint8 frames at the bucket's size (e.g. `video=` as a list of
    frames)."""

    pipeline_inputs: Callable[[np.ndarray], dict[str, Any]]
