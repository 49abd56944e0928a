"""Motion magnitude: how much the picture moves from frame to frame, against the training clips' own.

`metrics.flow` picks the estimate, averaged over every pair of consecutive frames:
- "opencv": dense optical flow (OpenCV's Farneback, with the parameters of its documentation's example: pyramid scale
  0.5, 3 levels, window 15, 3 iterations, polynomial 5 / 1.2) on the frames' luma; the mean length of the flow
  vectors, in pixels per frame at the video's size. Needs opencv-python-headless (`pip install 'vt[metrics]'`).
- "difference": the mean absolute difference of consecutive frames' luma, as a share of full scale (0 to 1): no
  extra package, but it measures change, not displacement (a flash counts; a textureless pan barely does).
Two identical frames have no motion: their pair counts 0 (Farneback's estimate on them is noise of a few thousandths
of a pixel from flat regions). The references are read at the render's size and fps, so `motion_ratio` (the
render's motion over the reference clips' mean) is in the same units on both sides: about 1 moves like the data,
near 0 is a still picture.
"""

from __future__ import annotations

import numpy as np

FARNEBACK = (0.5, 3, 15, 3, 5, 1.2, 0)  # pyr_scale, levels, winsize, iterations, poly_n, poly_sigma, flags
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # BT.601, as OpenCV's RGB2GRAY


def luma(frames: np.ndarray) -> np.ndarray:
    """(..., H, W, 3) uint8 RGB -> (..., H, W) float32 in [0, 255]."""
    return frames.astype(np.float32) @ LUMA


def motion(frames: np.ndarray, method: str) -> float | None:
    """The mean motion over consecutive pairs of `frames` (F, H, W, 3); None for a single frame."""
    if len(frames) < 2:
        return None
    return float(np.mean([pair_motion(a, b, method) for a, b in zip(frames[:-1], frames[1:])]))


def pair_motion(a: np.ndarray, b: np.ndarray, method: str) -> float:
    if np.array_equal(a, b):
        return 0.0
    if method == "opencv":
        import cv2

        gray = [cv2.cvtColor(np.ascontiguousarray(f), cv2.COLOR_RGB2GRAY) for f in (a, b)]
        flow = cv2.calcOpticalFlowFarneback(gray[0], gray[1], None, *FARNEBACK)
        return float(np.linalg.norm(flow, axis=-1).mean())
    return float(np.abs(luma(b) - luma(a)).mean() / 255)


def change_energy(frames: np.ndarray) -> np.ndarray:
    """The picture's change arriving at each frame t = 1 .. F-1: mean |luma(t) - luma(t-1)| / 255 (the visual onsets
    the audio-video offset lines the sound's onsets up with)."""
    values = luma(frames)
    return np.abs(np.diff(values, axis=0)).mean(axis=(1, 2)) / 255
