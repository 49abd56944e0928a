"""Wan 2.1 VACE (Wan-AI/Wan2.1-VACE-1.3B-diffusers, 14B): Wan 2.1 text-to-video steered by a control video.

What is particular to it, and why: docs/families.md, "Wan 2.1 VACE (control video)".
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.pipeline import to_pil_image
from vt.shared.models.roles import ControlVideo
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.models.wan import WanSpec, block_names

CONDITIONING_SCALE = 1.0  # WanVACEPipeline's default `conditioning_scale`, per VACE layer
# The modules of a VACE block a control LoRA trains by default (DiffSynth-Studio's q,k,v,o,ffn.0,ffn.2).
VACE_LORA_MODULES = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)


class WanVACESpec(WanSpec):
    family: ClassVar[str] = "wan-vace"
    tasks: ClassVar[tuple[str, ...]] = ("t2v",)
    example_hub_id: ClassVar[str] = "Wan-AI/Wan2.1-VACE-1.3B-diffusers"
    # WanVACEPipeline's `video=`: the control video's frames as PIL images (no `mask=`: the full mask).
    control_video: ClassVar[ControlVideo] = ControlVideo(
        pipeline_inputs=lambda control: {"video": [to_pil_image(frame) for frame in control]}
    )
    components: ClassVar[dict[str, str]] = {**WanSpec.components, "transformer": "diffusers:WanVACETransformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:WanVACEPipeline"}
    # In running order: every VACE block runs before the first main block (their hints are added after the
    # main blocks of `vace_layers`), so FSDP keeps the last main block gathered for the backward, as for Wan.
    block_lists: ClassVar[tuple[str, ...]] = ("vace_blocks", "blocks")
    pipeline_refusal: ClassVar[str] = (
        "its VACE blocks run on the control tokens and each main block adds one VACE block's hint beside its input, "
        "so a block's output is not the next block's whole input, which is what a pipeline stage hands on"
    )
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        *block_names("vace_blocks"),
        (r"vace_blocks\.(\d+)\.proj_in", r"vace_blocks.\1.before_proj"),
        (r"vace_blocks\.(\d+)\.proj_out", r"vace_blocks.\1.after_proj"),
        *WanSpec.original_names,
    )

    @property
    def default_lora_targets(self) -> list[str]:  # type: ignore[override]
        """The VACE blocks' attention and FFN, by full name (a suffix would also reach the main blocks)."""
        layers = len(self.load_config("transformer")["vace_layers"])
        return [f"vace_blocks.{n}.{module}" for n in range(layers) for module in VACE_LORA_MODULES]

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """Wan's t2v check, and a control input of [inactive, reactive] latents (2C) plus spatial^2 mask channels."""
        super()._check_task_fits(transformer, g)
        expected = 2 * g.channels + g.spatial**2
        if not transformer.get("vace_layers") or transformer.get("vace_in_channels") != expected:
            raise UserError(
                f"family {self.family!r} needs a Wan VACE transformer (vace_layers, vace_in_channels "
                f"{expected}, e.g. {self.example_hub_id}); the one at {self.source('transformer')[0]!r} "
                f"has vace_layers {transformer.get('vace_layers')}, vace_in_channels "
                f"{transformer.get('vace_in_channels')}"
            )

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor, control: Tensor | None = None) -> dict[str, Tensor]:
        """Wan's latents, and `control_latents` of the control video (`encode_control`)."""
        self._check_video(video)
        if control is None:
            raise ValueError(
                f"{self.family} conditions every clip on its control video: call "
                "encode_video(encoders, video, control=...) with the control clip (B, 3, F, H, W)"
            )
        if control.shape != video.shape:
            raise ValueError(f"control video {tuple(control.shape)} must have the clip's shape {tuple(video.shape)}")
        latents = super().encode_video(encoders, video)
        return {**latents, "control_latents": self.encode_control(encoders["vae"], control)}

    @torch.no_grad()
    def encode_control(self, vae, control: Tensor) -> Tensor:
        """WanVACEPipeline.prepare_video_latents(video=control) under the full mask, no reference images: (B, 2C, F,
        H, W) float32, [inactive (the zero video, encoded once), reactive], each normalised in the VAE's dtype."""
        video = control.to(vae.device, vae.dtype)
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=vae.device, dtype=torch.float32).view(shape)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=vae.device, dtype=torch.float32).view(shape)

        def normalised(pixels: Tensor) -> Tensor:
            return ((self.vae_mode(vae, pixels).float() - mean) * inv_std).to(vae.dtype)

        inactive = normalised(torch.zeros_like(video[:1])).expand(video.shape[0], -1, -1, -1, -1)
        return torch.cat([inactive, normalised(video)], dim=1).float()

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = super().condition_shapes(bucket)
        channels, *grid = shapes["latents"]
        return {**shapes, "control_latents": (2 * channels, *grid)}

    def control_mask(self, latents: Tensor) -> Tensor:
        """WanVACEPipeline.prepare_masks of the full mask: all ones, (B, spatial^2, F, H, W) at the latent grid."""
        return latents.new_ones(latents.shape[0], self.geometry.spatial**2, *latents.shape[2:])

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """Wan t2v's, with the pipeline's `control_hidden_states` [control_latents, mask] and its scale per layer."""
        if "control_latents" not in batch:
            raise KeyError(
                f"{self.family} needs batch['control_latents']; precompute the shards with model.family = "
                f"{self.family!r} (each raw sample with its control video)"
            )
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        control = torch.cat([batch["control_latents"].to(x0), self.control_mask(x0)], dim=1)
        scale = torch.full((len(transformer.config.vace_layers),), CONDITIONING_SCALE, device=x0.device, dtype=dtype)
        return self._predict(
            transformer,
            batch,
            x0,
            noise,
            noisy,
            sigmas * NUM_TRAIN_TIMESTEPS,
            control_hidden_states=control.to(dtype),
            control_hidden_states_scale=scale,
        )

    def inference_settings(self) -> dict[str, Any]:
        return {**super().inference_settings(), "conditioning_scale": CONDITIONING_SCALE}

    # No TP or CP plan yet (the base's None): the VACE blocks would need split points of their own (docs/parallel.md).
    tp_plan = ModelSpec.tp_plan
    cp_plan = ModelSpec.cp_plan
