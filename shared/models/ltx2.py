"""LTX-2 (Lightricks, audio + video; 2.0 and 2.3 checkpoints in diffusers' layout): Gemma 3 text encoder with text
connectors, causal video VAE (x8 time, x32 space), a DiT with a video and an audio stream joined by cross-attention,
an audio VAE and a vocoder. Built on LTX-Video's spec: its latent normalisation, token packing, frame-rate RoPE,
geometry and ComfyUI names. What is particular to it, and why: docs/families.md, "LTX-2"."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.errors import UserError
from vt.shared.models.components import load_class
from vt.shared.models.flow import (
    NUM_TRAIN_TIMESTEPS,
    FlowRecipe,
    Prediction,
    flow_inputs,
    flow_match_noisy,
    input_dtype,
)
from vt.shared.models.ltx2_sound import LTX2Sound
from vt.shared.models.ltx_video import LTXVideoSpec
from vt.shared.models.plans import ContextParallelPlan, CrossStreamPlan
from vt.shared.models.roles import SoundStream
from vt.shared.models.spec import VaeGeometry

_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")
# Default LoRA targets (suffixes): the video self- and cross-attention, which never match `audio_attn1.to_q`
# and the like; with model.audio also the audio stream's and both audio-video cross-attention directions'.
VIDEO_LORA_TARGETS = [f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in _PROJECTIONS]
AUDIO_LORA_TARGETS = [
    f"{attn}.{proj}"
    for attn in ("audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    for proj in _PROJECTIONS
]
# The vocoder classes a checkpoint's vocoder/config.json may name: LTX-2.0's, LTX-2.3's with bandwidth extension.
VOCODERS = ("LTX2Vocoder", "LTX2VocoderWithBWE")


class LTX2Spec(LTXVideoSpec):
    family: ClassVar[str] = "ltx-2"
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "connectors", "vae")
    text_masks: ClassVar[dict[str, str]] = {}
    noisy_first_frame: ClassVar[bool] = False
    sound_stream: ClassVar[type[SoundStream]] = LTX2Sound
    _vocoder: type | None = None  # the vocoder class the checkpoint names (component_classes)
    example_hub_id: ClassVar[str] = "Lightricks/LTX-2"
    # Lightricks/LTX-2's ltx-trainer: its "shifted_logit_normal" stretched to [0, 1] with a tenth of the draws
    # uniform, shifted by token count as LTX-Video's ("auto"); an unweighted loss (docs/families.md).
    flow_recipe: ClassVar[FlowRecipe] = FlowRecipe("stretched_logit_normal", "auto", "none")
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:Gemma3ForConditionalGeneration",
        "connectors": "diffusers.pipelines.ltx2:LTX2TextConnectors",
        "vae": "diffusers:AutoencoderKLLTX2Video",
        "audio_vae": "diffusers:AutoencoderKLLTX2Audio",
        "vocoder": "diffusers.pipelines.ltx2.vocoder:LTX2Vocoder",
        "transformer": "diffusers:LTX2VideoTransformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:LTX2Pipeline", "i2v": "diffusers:LTX2ImageToVideoPipeline"}

    @property
    def default_lora_targets(self) -> list[str]:  # type: ignore[override]
        return VIDEO_LORA_TARGETS + AUDIO_LORA_TARGETS if self.config.audio else VIDEO_LORA_TARGETS

    def component_classes(self) -> dict[str, type]:
        """The vocoder's class as its config.json names it (LTX-2.3's has bandwidth extension)."""
        classes = super().component_classes()
        if self._vocoder is None:
            path, subfolder = self.source("vocoder")
            try:
                name = classes["vocoder"].load_config(path, subfolder=subfolder).get("_class_name")
            except (OSError, ValueError) as err:
                raise self.load_error("vocoder", path, err) from err
            if name not in VOCODERS:
                raise UserError(
                    f"the vocoder at {path!r} is a {name!r}; ltx-2 loads {' or '.join(VOCODERS)}. Set "
                    "model.components.vocoder to an LTX-2 vocoder"
                )
            self._vocoder = load_class(f"diffusers.pipelines.ltx2.vocoder:{name}")
        return {**classes, "vocoder": self._vocoder}

    @functools.cached_property
    def cross_timestep(self) -> bool:
        """diffusers' `use_cross_timestep`: LTX-2.3 (prompt and cross-attention modulation, `cross_attn_mod`)
        modulates each stream's audio-video cross-attention by the other stream's sigma, LTX-2.0 by its own."""
        transformer = self.load_config("transformer")
        return bool(transformer.get("cross_attn_mod") or transformer.get("audio_cross_attn_mod"))

    def _geometry_from_config(self) -> VaeGeometry:
        """i2v takes the clip's first latent frame as the pipeline's image latent: that needs a causal encoder (the
        first frame encoded alone) and scaling factor 1 (the pipeline normalises the image without it)."""
        geometry = super()._geometry_from_config()
        vae = self._vae_without_weights().config if self.frame_conditions else None
        if vae and (not vae.encoder_causal or vae.scaling_factor != 1.0):
            raise UserError(
                f'model.task = "i2v" on ltx-2 needs a causal video VAE encoder with scaling_factor 1 '
                f"(as Lightricks/LTX-2's): the VAE at {self.source('vae')[0]!r} has encoder_causal "
                f"{vae.encoder_causal}, scaling_factor {vae.scaling_factor}"
            )
        return geometry

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """The connectors' video text embedding and mask of the pipeline's Gemma encoding; model.audio: + audio's."""
        embeds, mask, _, _ = self._encode_prompt(encoders, captions, do_classifier_free_guidance=False)
        connectors = encoders["connectors"]
        padding_side = getattr(encoders["tokenizer"], "padding_side", "left")  # the pipeline's: left
        video, audio, video_mask = connectors(
            embeds.to(connectors.device, connectors.dtype), mask.to(connectors.device), padding_side=padding_side
        )
        out = {"prompt_embeds": video.float(), "prompt_attention_mask": video_mask.float()}
        if self.config.audio:
            out["audio_prompt_embeds"] = audio.float()
        return out

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """The connectors' video text embedding (heads x head dim wide) and its mask."""
        connectors = self.load_config("connectors")
        width = connectors["video_connector_num_attention_heads"] * connectors["video_connector_attention_head_dim"]
        shapes = {
            "prompt_embeds": (self.max_text_tokens, width),
            "prompt_attention_mask": (self.max_text_tokens,),
            "latents": self.latent_shape(bucket),
        }
        if self.config.audio:
            shapes["audio_prompt_embeds"] = (
                self.max_text_tokens,
                connectors["audio_connector_num_attention_heads"] * connectors["audio_connector_attention_head_dim"],
            )
            shapes["audio_latents"] = self.sound.latent_shape(bucket)
        return shapes

    @torch.no_grad()
    def encode_validation_text(self, encoders, prompt: str) -> dict[str, Tensor]:
        """Gemma's stacked hidden states before the connectors: LTX2Pipeline runs its `connectors` itself."""
        return self._prompt_and_mask(encoders, [prompt])

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """The latents alone, for i2v too: their first frame is the image latent."""
        self._check_video(video)
        return {"latents": self._encode(encoders["vae"], video)}

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """model.audio: the audio's terms in `Prediction.audio`; i2v: the first latent frame clean, out of the loss."""
        from diffusers import LTX2Pipeline

        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        patch = self.geometry.patch
        grid = (x0.shape[2], x0.shape[3] // patch, x0.shape[4] // patch)
        dtype = input_dtype(transformer)
        timestep = (sigmas * NUM_TRAIN_TIMESTEPS).to(x0.device)  # float32, as the pipeline passes it
        video_timestep, weight = timestep, None
        if self.frame_conditions:  # the image latent, clean, as the pipeline's prepare_latents puts it there
            noisy = torch.cat([x0[:, :, :1], noisy[:, :, 1:]], dim=2)
            video_timestep = self.token_timesteps(timestep, grid)
            weight = torch.ones(1, 1, grid[0], 1, 1, device=x0.device)
            weight[:, :, 0] = 0
        tokens = LTX2Pipeline._pack_latents(noisy, patch, 1).to(dtype)
        text = batch["prompt_embeds"].to(tokens.device, dtype)
        mask = batch["prompt_attention_mask"].to(tokens.device)
        # the audio stream's sigma: the sample's, or its own (model.audio_timesteps = "independent")
        audio_sigmas = batch["audio_sigmas"].to(sigmas) if "audio_sigmas" in batch else sigmas
        audio_timestep = (audio_sigmas * NUM_TRAIN_TIMESTEPS).to(tokens.device)
        if self.config.audio:  # packed as the pipeline packs them: every mel bin of a latent frame in one token
            if "audio_noise" not in batch:
                raise UserError(
                    "model.audio: the batch has audio_latents but no audio_noise; the trainer draws it "
                    "(train/parallel/batching.py draw_audio_noise)"
                )
            audio_x0 = batch["audio_latents"].float().to(mask.device)
            audio_noise = batch["audio_noise"].to(audio_x0)
            noisy_audio = flow_match_noisy(audio_x0, audio_noise, audio_sigmas)
            audio = dict(
                audio_hidden_states=LTX2Pipeline._pack_audio_latents(noisy_audio).to(dtype),
                audio_encoder_hidden_states=batch["audio_prompt_embeds"].to(mask.device, dtype),
                audio_encoder_attention_mask=mask,  # the video's: the pipeline passes it to both streams
                audio_num_frames=audio_x0.shape[2],
                isolate_modalities=False,
                use_cross_timestep=self.cross_timestep,
            )  # modulated as validation samples
        else:  # one zero audio token (the class needs one), the cross-attention off: the video prediction ignores it
            audio = dict(
                audio_hidden_states=text.new_zeros(len(text), 1, transformer.config.audio_in_channels),
                audio_encoder_hidden_states=text.new_zeros(len(text), 1, text.shape[-1]),
                audio_num_frames=1,
                isolate_modalities=True,
            )
        video_out, audio_out = transformer(
            hidden_states=tokens,
            encoder_hidden_states=text,
            timestep=video_timestep,
            audio_timestep=audio_timestep,
            sigma=timestep,
            audio_sigma=audio_timestep,
            encoder_attention_mask=mask,
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            fps=self.frame_rate,
            return_dict=False,
            **audio,
        )
        prediction = LTX2Pipeline._unpack_latents(video_out, *grid, patch, 1).float()
        out = Prediction(prediction=prediction, target=noise - x0, weight=weight)
        if self.config.audio:
            audio_out = LTX2Pipeline._unpack_audio_latents(audio_out, *audio_x0.shape[2:]).float()
            out.audio = Prediction(prediction=audio_out, target=audio_noise - audio_x0, weight=None)
        return out

    @staticmethod
    def token_timesteps(timestep: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """LTX2ImageToVideoPipeline's `timestep.unsqueeze(-1) * (1 - conditioning_mask)`: (B, F x H x W), frame-major,
        0 on the first latent frame's tokens."""
        per_token = torch.ones(grid[0], grid[1] * grid[2], device=timestep.device)
        per_token[0] = 0
        return timestep[:, None] * per_token.flatten()[None]

    def cp_plan(self) -> ContextParallelPlan:
        """The video tokens split, the audio stream whole on every rank (docs/parallel.md, `ltx-2`)."""
        split = self.load_config("transformer").get("rope_type", "interleaved") == "split"
        cross = CrossStreamPlan(
            queries_whole=("video_to_audio_attn",),
            queries_split=("audio_to_video_attn",),
            rope_dims=(-2, -3) if split else (-2, -1),
        )
        return ContextParallelPlan(
            split_inputs={"": {"hidden_states": 1, "timestep": 1}},
            gather_output="proj_out",
            self_attention=("attn1",),
            sequence_to_heads=("norm_q", "norm_k", "to_v", "to_gate_logits"),
            rope_heads={"rope": -3 if split else -1},
            cross_stream=cross,
        )

    def tp_plan(self) -> None:
        return None  # each block also holds the audio stream and the audio-video attention (docs/parallel.md)

    def pipeline_inputs(
        self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None, last_image=None
    ) -> dict[str, Any]:
        """`use_cross_timestep` as diffusers samples each version (`cross_timestep`)."""
        return {
            **super().pipeline_inputs(prompt, bucket, steps, seed, image, last_image),
            "use_cross_timestep": self.cross_timestep,
        }
