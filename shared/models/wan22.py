"""Wan 2.2 A14B (text- and image-to-video): two Wan transformers, experts for high and low noise levels.

Everything per expert is Wan 2.1 (wan.py): the UMT5 text encoder, the 16-channel VAE, the DiT, the
flow-matching objective, the TP and CP plans and the original module names for ComfyUI. What is
particular:
- WanPipeline holds `transformer` (high noise) and `transformer_2` (low noise) and a
  `boundary_ratio` (0.875 for T2V-A14B, 0.9 for I2V-A14B): a denoising step at timestep
  t >= boundary * 1000 runs the first, any later one the second. Training follows that split:
  `model.expert = "high_noise"` trains `transformer` on sigmas in [boundary, 1], `"low_noise"` trains
  `transformer_2` on [0, boundary); the trainer maps its drawn sigmas into the expert's range
  (`sigma_range`).
- One expert per run: its LoRA is written for diffusers (load the low-noise one with
  `load_lora_weights(..., load_into_transformer_2=True)`) and for ComfyUI as
  `lora_comfyui_<expert>.safetensors`, one file per expert model. Validation runs the whole
  two-expert pipeline with the other expert frozen.
- Or both in one run (`model.expert = "all"`): each sample's sigma picks its expert (`expert_of`),
  and the LoRA of each is `pytorch_lora_weights_<expert>.safetensors` plus its ComfyUI file.
- Image-to-video (`model.task = "i2v"`, I2V-A14B): WanImageToVideoPipeline with no CLIP image
  encoder: the transformer takes [noisy (16), first-frame mask (4), encoded [image, zeros] (16)]
  channels as Wan 2.1 I2V (wan.py) but no image tokens, so any text length works.
TI2V-5B (one transformer, 48-channel VAE, per-token timesteps) is family "wan2.2-ti2v" (wan22_ti2v.py).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

from vt.shared.errors import UserError
from vt.shared.models.wan import WanSpec

HIGH, LOW = "high_noise", "low_noise"


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
        ratio = index.get("boundary_ratio")
        if not ratio:
            hint = ("family \"wan2.2-ti2v\" for Wan 2.2 TI2V-5B" if index.get("expand_timesteps")
                    else "family \"wan\" for one transformer")
            raise UserError(f"model.path = {self.config.path!r} has no boundary_ratio in model_index.json: "
                             f"not a two-expert Wan 2.2 pipeline; use {hint}")
        return float(ratio)

    def experts(self) -> dict[str, tuple[str, tuple[float, float]]]:
        boundary = self.boundary
        return {HIGH: ("transformer", (boundary, 1.0)), LOW: ("transformer_2", (0.0, boundary))}

    def pipeline_options(self) -> dict[str, Any]:
        return {"boundary_ratio": self.boundary}

    def lora_load_kwargs(self, expert: str | None = None) -> dict[str, Any]:
        component = self.experts()[expert or self.expert][0]
        return {"load_into_transformer_2": True} if component == "transformer_2" else {}
