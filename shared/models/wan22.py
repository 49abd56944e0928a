"""Wan 2.2 A14B (text- and image-to-video): two Wan transformers, experts for high and low noise levels.

What is particular to it, and why: docs/families.md, "Wan 2.2".
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

from vt.shared.errors import UserError
from vt.shared.models.wan import WanSpec


class Wan22Spec(WanSpec):
    family: ClassVar[str] = "wan2.2"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    example_hub_id: ClassVar[str] = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    clip_image_conditioning: ClassVar[bool] = False
    components: ClassVar[dict[str, str]] = {**WanSpec.components, "transformer_2": WanSpec.components["transformer"]}
    task_components: ClassVar[dict[str, dict[str, str]]] = {}  # no CLIP image encoder

    @cached_property
    def boundary(self) -> float:
        """The pipeline's boundary_ratio (model_index.json): the sigma where the experts hand over."""
        from diffusers import DiffusionPipeline

        try:
            index = DiffusionPipeline.load_config(self.config.path)
        except (OSError, ValueError) as err:
            raise self.load_error("model_index.json", self.config.path, err) from err
        if not index.get("boundary_ratio"):
            hint = (
                'family "wan2.2-ti2v" for Wan 2.2 TI2V-5B'
                if index.get("expand_timesteps")
                else 'family "wan" for one transformer'
            )
            raise UserError(
                f"model.path = {self.config.path!r} has no boundary_ratio in model_index.json: "
                f"not a two-expert Wan 2.2 pipeline; use {hint}"
            )
        return float(index["boundary_ratio"])

    def experts(self) -> dict[str, tuple[str, tuple[float, float]]]:
        boundary = self.boundary
        return {"high_noise": ("transformer", (boundary, 1.0)), "low_noise": ("transformer_2", (0.0, boundary))}

    def pipeline_options(self) -> dict[str, Any]:
        return {"boundary_ratio": self.boundary}

    def lora_load_kwargs(self, expert: str | None = None) -> dict[str, Any]:
        component = self.experts()[expert or self.expert][0]
        return {"load_into_transformer_2": True} if component == "transformer_2" else {}
