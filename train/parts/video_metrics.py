"""Metrics of each validation video (`[metrics]`), computed on a thread beside training (vt.train.video_metrics).

Each metric is on while its model or method is named: prompt adherence (`clip`: CLIP or SigLIP), likeness to the
training and held-out clips (`likeness`: DINOv2 or CLIP, with `reference` / `reference_held_out`), temporal
consistency (with either image model), motion against the training clips' (`flow`), and for runs with sound
(model.audio) the sound against the prompt (`clap`) and its offset from the picture (`av_offset`).

After each validation every rank hands the videos it wrote to its own worker (the ranks that write none load no
model), then the records finished so far on every rank are gathered to rank 0, which logs them in metrics.jsonl under
the step of their videos; at the end of the run each rank waits for its worker and the rest are gathered alike. So the
trainer waits for the metrics only once, after the last validation; a validation's metrics reach metrics.jsonl at a
later validation or at the end.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.train.parts.base import Part, RunContext

log = get_logger("vt.train.parts.video_metrics")
NAME = re.compile(r"^(\d+)(?:[-_](\w+))?$")  # a validation video's stem: "03" (the trained model's), "03-base"


def video_of(path: Path) -> tuple[int, str] | None:
    """(prompt index, kind) of a validation video's file name ("base" in validation/base/: `validation.base`); None
    for a name validation does not write."""
    match = NAME.match(Path(path).stem)
    if not match:
        return None
    index, kind = int(match[1]), match[2] or "lora"
    if Path(path).parent.name != "base":
        return index, kind
    return index, "base" if kind == "lora" else f"base_{kind}"


def prompt_means(records: list[tuple[int, dict]], prompts: int, seen: dict) -> list[tuple[int, dict]]:
    """`records` plus, for each step and metric whose `prompts` per-prompt values are all in (now or in `seen`, which
    keeps the ones still waiting), their mean under the key without the prompt (`val/likeness`)."""
    out = list(records)
    for step, values in records:
        for key, value in values.items():
            head, _, prompt = key.rpartition("/")
            if prompt.isdigit():
                waiting = seen.setdefault((step, head), {})
                waiting[prompt] = value
                if len(waiting) == prompts:
                    out.append((step, {head: sum(seen.pop((step, head)).values()) / prompts}))
    return out


class VideoMetricsPart(Part):
    section = "metrics"

    @classmethod
    def wanted(cls, config) -> bool:
        s = config.metrics
        return bool(s.clip or s.likeness or s.flow or s.clap or s.av_offset)

    def check(self, spec, world_size: int) -> None:
        s = self.settings
        if s.likeness and not s.reference:
            raise UserError(
                f"metrics.likeness = {s.likeness!r} compares the validation videos with the training clips: set "
                'metrics.reference to them (video files or folders, e.g. "runs/data/clips"), or unset metrics.likeness'
            )
        if s.reference_held_out and not s.likeness:
            raise UserError(
                "metrics.reference_held_out is compared through metrics.likeness, which is not set: name an image "
                'model there (e.g. "facebook/dinov2-base"), or remove metrics.reference_held_out'
            )
        for key, on in (("clap", s.clap), ("av_offset", s.av_offset)):
            if on and not self.config.model.audio:
                raise UserError(
                    f"metrics.{key} scores the validation videos' sound, which this run does not generate "
                    "(model.audio = false): set model.audio = true (a family with sound), or unset it"
                )
        if not self.config.validation.prompts:
            log.warning("[metrics] is set but validation.prompts is empty: there are no videos to score")

    def check_machine(self, device: torch.device) -> None:
        from vt.train.video_metrics.media import video_files
        from vt.train.video_metrics.models import check_checkpoint

        for key in ("clip", "likeness", "clap"):
            if getattr(self.settings, key):
                check_checkpoint(key, getattr(self.settings, key))
        video_files(self.settings.reference, "metrics.reference")  # they exist and hold videos
        video_files(self.settings.reference_held_out, "metrics.reference_held_out")
        if self.settings.flow == "opencv":
            try:
                import cv2  # noqa: F401
            except ImportError as err:
                raise UserError(
                    "metrics.flow = \"opencv\" needs OpenCV: pip install opencv-python-headless (or 'vt[metrics]'), "
                    'or set metrics.flow = "difference"'
                ) from err

    def start(self, run: RunContext) -> None:
        self.world = run.world
        self.device = run.device if self.settings.device == "training" else torch.device("cpu")
        self.metrics = None  # this rank's worker, made at its first video
        self.waiting: dict = {}  # rank 0: (step, metric) -> the prompts' values in so far (their mean when all are)

    def after_validation(self, step: int, videos: list[Path]) -> list[tuple[int, dict]]:
        from vt.train.video_metrics import Scorer, VideoMetrics

        prompts = self.config.validation.prompts
        for path in videos:
            found = video_of(path)
            if found is None:
                continue
            if self.metrics is None:
                self.metrics = VideoMetrics(Scorer(self.settings, self.config.buckets.fps, self.device))
            index, kind = found
            self.metrics.submit(step, index, path, prompts[index] if index < len(prompts) else "", kind)
        return self._gathered(self.metrics.done() if self.metrics is not None else [])

    def after_run(self) -> list[tuple[int, dict]]:
        return self._gathered(self.metrics.finish() if self.metrics is not None else [])

    def _gathered(self, records: list) -> list[tuple[int, dict]]:
        """Every rank's `records` on rank 0, by step (every rank calls it; [] elsewhere)."""
        ranks = self.world.gather_objects(records)
        if ranks is None:
            return []
        gathered = [r for rank in ranks for r in rank]
        return sorted(prompt_means(gathered, len(self.config.validation.prompts), self.waiting), key=lambda r: r[0])
