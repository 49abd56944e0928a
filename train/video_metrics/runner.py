"""The metrics of validation videos, computed on a thread of their own while training goes on.

`VideoMetrics.submit(...)` queues a written video and returns at once; the worker thread loads the metric models at
its first video (so a rank that writes no video loads none), reads the references once at that video's size and fps,
and scores each video in turn. `done()` hands over what is finished without waiting; `finish()` waits for the rest
and stops the thread (the run's end). A failure on the thread (a checkpoint that does not load, an unreadable
reference) is raised by the next call, so it stops the run at its next validation or at its end.

A record is (step, {"val/<metric>/<prompt>": value}): the prompt as the video's two-digit index, `val/<kind>/...` for
renders other than the trained model's (kind "lora"). A metric that is undefined for a video (motion of one frame,
the offset of a silent track) is left out of its record.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vt.shared.log import get_logger
from vt.train.video_metrics.likeness import consistency, likeness
from vt.train.video_metrics.media import Clip, read_clip, read_references, sample, video_files
from vt.train.video_metrics.models import Encoder
from vt.train.video_metrics.motion import motion
from vt.train.video_metrics.prompt import prompt_score
from vt.train.video_metrics.sound import audio_prompt, av_offset_ms

log = get_logger("vt.train.video_metrics")


@dataclass(frozen=True)
class Video:
    step: int
    index: int  # the validation prompt's index
    path: Path
    prompt: str
    kind: str = "lora"  # whose render: the trained model's, or e.g. "base"

    def key(self, metric: str) -> str:
        scope = "" if self.kind == "lora" else f"{self.kind}/"
        return f"val/{scope}{metric}/{self.index:02d}"


class Scorer:
    """The metrics `settings` ([metrics]) turn on, for one video at a time (on the worker thread)."""

    def __init__(self, settings, fps: float, device: torch.device):
        self.settings, self.fps, self.device = settings, fps, device
        self.encoders: dict[str, Encoder] | None = None
        self.references: dict[str, tuple[list[np.ndarray], torch.Tensor | None]] | None = None
        self.reference_motion: float | None = None

    def _load(self) -> dict[str, Encoder]:
        if self.encoders is None:
            names = {key: getattr(self.settings, key) for key in ("clip", "likeness", "clap")}
            self.encoders = {key: Encoder(key, name, self.device) for key, name in names.items() if name}
        return self.encoders

    @property
    def image_encoder(self) -> Encoder | None:
        """Temporal consistency's and likeness's embeddings: the likeness model's, else the CLIP model's images."""
        return self.encoders.get("likeness") or self.encoders.get("clip")

    def _read_references(self, like: Clip) -> None:
        """The reference clips at `like`'s size and fps, their sampled frames' embeddings and their mean motion."""
        settings, self.references = self.settings, {}
        for metric, key in (("likeness", "reference"), ("likeness_held_out", "reference_held_out")):
            clips = read_references(video_files(getattr(settings, key), f"metrics.{key}"), like, f"metrics.{key}")
            if not clips:
                continue
            embedded = None
            if "likeness" in self.encoders:
                frames = np.concatenate([clip[sample(len(clip), settings.frames)] for clip in clips])
                embedded = self.encoders["likeness"].images(frames)
            self.references[metric] = (clips, embedded)
        training = self.references.get("likeness", ([], None))[0]
        if settings.flow and training:
            self.reference_motion = float(np.mean([motion(clip, settings.flow) for clip in training]))

    def score(self, video: Video) -> dict[str, float]:
        settings, encoders = self.settings, self._load()
        clip = read_clip(video.path, self.fps)
        if self.references is None:
            self._read_references(clip)
        values: dict[str, float | None] = {}
        if "clip" in encoders:
            values["prompt"] = prompt_score(encoders["clip"], clip.frames, video.prompt, settings.frames)
        embedded = self.image_encoder.images(clip.frames) if self.image_encoder is not None else None
        if embedded is not None:
            values["consistency"] = consistency(embedded)
        if "likeness" in encoders:  # then `embedded` is the likeness model's
            sampled = embedded[sample(len(clip.frames), settings.frames)]
            for metric, (_, reference) in self.references.items():
                values[metric] = likeness(sampled, reference)
        if settings.flow:
            values["motion"] = moved = motion(clip.frames, settings.flow)
            if moved is not None and self.reference_motion:
                values["motion_ratio"] = moved / self.reference_motion
        if clip.sound is not None and "clap" in encoders:
            values["audio_prompt"] = audio_prompt(encoders["clap"], clip.sound, video.prompt)
        if clip.sound is not None and settings.av_offset:
            values["av_offset_ms"] = av_offset_ms(clip.frames, clip.sound, self.fps)
        return {video.key(metric): value for metric, value in values.items() if value is not None}


class VideoMetrics:
    """Scores submitted videos on a daemon thread (see the module's docstring)."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.jobs: queue.Queue[Video | None] = queue.Queue()
        self.records: list[tuple[int, dict[str, float]]] = []
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def submit(self, step: int, index: int, path: Path, prompt: str, kind: str = "lora") -> None:
        self._raise()
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="vt-video-metrics", daemon=True)
            self.thread.start()
        self.jobs.put(Video(step, index, Path(path), prompt, kind))

    def done(self) -> list[tuple[int, dict[str, float]]]:
        """The records finished since the last call (never waits)."""
        self._raise()
        with self.lock:
            records, self.records = self.records, []
        return records

    def finish(self) -> list[tuple[int, dict[str, float]]]:
        """Wait for every submitted video, stop the thread; the records not handed over yet."""
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None
        return self.done()

    def _work(self) -> None:
        while (video := self.jobs.get()) is not None:
            if self.error is not None:
                continue  # drained: the error stops the run at the next call
            try:
                values = self.scorer.score(video)
            except Exception as err:  # raised again on the caller's thread
                log.error("video metrics of %s failed: %s", video.path, err)
                self.error = err
                continue
            with self.lock:
                self.records.append((video.step, values))

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
