"""Metrics of validation videos (the `[metrics]` part, train/parts/video_metrics.py): one module per kind of metric,
each computed with a model of its field loaded through its own library, and a runner that computes them beside
training (runner.py). docs/stage2.md, "Video metrics", says what each metric is."""

from vt.train.video_metrics.runner import Scorer, Video, VideoMetrics

__all__ = ["Scorer", "Video", "VideoMetrics"]
