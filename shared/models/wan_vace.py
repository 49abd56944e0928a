"""Wan 2.1 VACE (Wan-AI/Wan2.1-VACE-1.3B-diffusers, 14B): Wan 2.1 text-to-video steered by a control video.

What is particular to it, and why: docs/families.md, "Wan 2.1 VACE (control video)".
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.roles import ControlVideo
from vt.shared.models.spec import VaeGeometry
from vt.shared.models.wan import WanSpec

CONDITIONING_SCALE = 1.0  # WanVACEPipeline's default `conditioning_scale`, per VACE layer
# The modules of a VACE block a control LoRA trains by default (DiffSynth-Studio's q,k,v,o,ffn.0,ffn.2).
VACE_LORA_MODULES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")


def video_frames(control) -> dict[str, Any]:
    """WanVACEPipeline's `video=`: the control video's frames as PIL images (no `mask=`: the full mask)."""
    from PIL import Image

    return {"video": [Image.fromarray(frame) for frame in control]}


class WanVACESpec(WanSpec):
    family: ClassVar[str] = "wan-vace"
    tasks: ClassVar[tuple[str, ...]] = ("t2v",)
    example_hub_id: ClassVar[str] = "Wan-AI/Wan2.1-VACE-1.3B-diffusers"
    control_video: ClassVar[ControlVideo] = ControlVideo(pipeline_inputs=video_frames)
    components: ClassVar[dict[str, str]] = {**WanSpec.components,
                                            "transformer": "diffusers:WanVACETransformer3DModel"}
    task_components: ClassVar[dict[str, dict[str, str]]] = {}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:WanVACEPipeline"}
    # In running order: every VACE block runs before the first main block (their hints are added after the
    # main blocks of `vace_layers`), so FSDP keeps the last main block gathered for the backward, as for Wan.
    block_lists: ClassVar[tuple[str, ...]] = ("vace_blocks", "blocks")
    pipeline_refusal: ClassVar[str] = (
        "its VACE blocks run on the control tokens and each main block adds one VACE block's hint beside its input, "
        "so a block's output is not the next block's whole input, which is what a pipeline stage hands on")
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        *((rf"vace_blocks\.(\d+)\.{attn}\.{ours}", rf"vace_blocks.\1.{theirs}.{short}")
          for attn, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
          for ours, short in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), (r"to_out\.0", "o"))),
        (r"vace_blocks\.(\d+)\.ffn\.net\.0\.proj", r"vace_blocks.\1.ffn.0"),
        (r"vace_blocks\.(\d+)\.ffn\.net\.2", r"vace_blocks.\1.ffn.2"),
        (r"vace_blocks\.(\d+)\.proj_in", r"vace_blocks.\1.before_proj"),
        (r"vace_blocks\.(\d+)\.proj_out", r"vace_blocks.\1.after_proj"),
        *WanSpec.original_names,
    )

    @property
    def vace_layers(self) -> list[int]:
        """The main blocks after which a VACE block's hint is added (the transformer config's `vace_layers`)."""
        return list(self.load_config("transformer")["vace_layers"])

    @property
    def default_lora_targets(self) -> list[str]:  # type: ignore[override]
        """The VACE blocks' attention and FFN, by full module name (peft matches a suffix, and the main blocks
        have the same names)."""
        return [f"vace_blocks.{n}.{module}" for n in range(len(self.vace_layers)) for module in VACE_LORA_MODULES]

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """Wan's t2v check, and a VACE transformer whose control input is what the pipeline makes:
        [inactive, reactive] latents (2C) plus the mask's spatial x spatial channels."""
        super()._check_task_fits(transformer, g)
        where = self.source("transformer")[0]
        expected = 2 * g.channels + g.spatial ** 2
        if not transformer.get("vace_layers") or transformer.get("vace_in_channels") != expected:
            raise UserError(f"family {self.family!r} needs a Wan VACE transformer (vace_layers, vace_in_channels "
                             f"{expected}, e.g. {self.example_hub_id}); the one at {where!r} has "
                             f"vace_layers {transformer.get('vace_layers')}, vace_in_channels "
                             f"{transformer.get('vace_in_channels')}")

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor, control: Tensor | None = None) -> dict[str, Tensor]:
        """Wan's normalised latents of `video`, and `control_latents` of its control video (B, 3, F, H, W),
        as WanVACEPipeline.prepare_video_latents makes them under a full mask (`encode_control`)."""
        self._check_video(video)
        if control is None:
            raise ValueError(f"{self.family} conditions every clip on its control video: call "
                             "encode_video(encoders, video, control=...) with the control clip (B, 3, F, H, W)")
        if control.shape != video.shape:
            raise ValueError(f"the control video {tuple(control.shape)} must have the clip's shape "
                             f"{tuple(video.shape)}")
        latents = super().encode_video(encoders, video)
        return {**latents, "control_latents": self.encode_control(encoders["vae"], control)}

    @torch.no_grad()
    def encode_control(self, vae, control: Tensor) -> Tensor:
        """WanVACEPipeline.prepare_video_latents(video=control, mask=ones, no reference images): the mask
        binarised (> 0.5: all ones), `inactive = video * (1 - mask)` (zeros) and `reactive = video * mask`
        VAE-encoded (mode), each normalised `(z.float() - mean) * (1 / std)` in the VAE's dtype, then
        [inactive, reactive] on the channel axis: (B, 2C, F, H, W) float32. The inactive video is zeros for
        every sample, so it is encoded once per call."""
        video = control.to(vae.device, vae.dtype)
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=vae.device, dtype=torch.float32).view(shape)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=vae.device, dtype=torch.float32).view(shape)

        def normalised(pixels: Tensor) -> Tensor:
            return ((self._vae_mode(vae, pixels).float() - mean) * inv_std).to(vae.dtype)

        inactive = normalised(torch.zeros_like(video[:1])).expand(video.shape[0], -1, -1, -1, -1)
        return torch.cat([inactive, normalised(video)], dim=1).float()

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = super().condition_shapes(bucket)
        channels, *grid = shapes["latents"]
        shapes["control_latents"] = (2 * channels, *grid)
        return shapes

    def control_mask(self, latents: Tensor) -> Tensor:
        """WanVACEPipeline.prepare_masks of the full mask for latents (B, C, F, H, W): each latent pixel's
        spatial x spatial pixel mask as channels at the latent grid, all ones: (B, spatial^2, F, H, W)."""
        batch, _, frames, height, width = latents.shape
        return latents.new_ones(batch, self.geometry.spatial ** 2, frames, height, width)

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """Wan t2v's flow matching, with the control tokens the pipeline feeds: `control_hidden_states` =
        [control_latents, mask] and `control_hidden_states_scale` = conditioning_scale per VACE layer, both in
        the transformer's dtype."""
        if "control_latents" not in batch:
            raise KeyError(f"{self.family} needs batch['control_latents']; precompute the shards with model.family = "
                           f"{self.family!r} (each raw sample with its control video)")
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        control = torch.cat([batch["control_latents"].to(x0), self.control_mask(x0)], dim=1)
        scale = torch.full((len(transformer.config.vace_layers),), CONDITIONING_SCALE, device=x0.device, dtype=dtype)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,  # float32, as the pipeline passes it
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            control_hidden_states=control.to(dtype),
            control_hidden_states_scale=scale,
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=None)

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        return {**super().inference_settings(), "conditioning_scale": CONDITIONING_SCALE}

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> None:
        """None yet: its VACE blocks would need their own checked split."""

    def cp_plan(self) -> None:
        """None yet: its VACE blocks take the tokens before the main blocks, so the split points differ from Wan's."""
