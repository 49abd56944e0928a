"""LTX-2 (Lightricks, audio + video; 2.0 and 2.3 checkpoints in diffusers' layout): Gemma 3 text encoder
with text connectors, causal video VAE (x8 time, x32 space), a DiT with a video and an audio stream
joined by cross-attention, an audio VAE and a vocoder.

What is particular to it, and why: docs/families.md, "LTX-2".
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.errors import UserError
from vt.shared.models.components import load_class
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, flow_match_noisy, input_dtype
from vt.shared.models.ltx2_sound import LTX2Sound
from vt.shared.models.plans import ContextParallelPlan, CrossStreamPlan
from vt.shared.models.roles import SoundStream
from vt.shared.models.spec import ModelSpec, VaeGeometry

_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")
# Default LoRA targets (suffixes): the video self- and cross-attention, which never match `audio_attn1.to_q`
# and the like; with model.audio also the audio stream's and both audio-video cross-attention directions'.
VIDEO_LORA_TARGETS = [f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in _PROJECTIONS]
AUDIO_LORA_TARGETS = [f"{attn}.{proj}" for attn in ("audio_attn1", "audio_attn2", "audio_to_video_attn",
                                                    "video_to_audio_attn") for proj in _PROJECTIONS]
# The vocoder classes a checkpoint's vocoder/config.json may name: LTX-2.0's, LTX-2.3's with bandwidth extension.
VOCODERS = {"LTX2Vocoder": "diffusers.pipelines.ltx2.vocoder:LTX2Vocoder",
            "LTX2VocoderWithBWE": "diffusers.pipelines.ltx2.vocoder:LTX2VocoderWithBWE"}


class LTX2Spec(ModelSpec):
    family: ClassVar[str] = "ltx-2"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "connectors", "vae")
    sound_stream: ClassVar[type[SoundStream]] = LTX2Sound
    default_lora_targets: ClassVar[list[str]] = VIDEO_LORA_TARGETS  # with model.audio: + AUDIO_LORA_TARGETS
    _vocoder: type | None = None  # the vocoder class the checkpoint names (component_classes)
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ((r"(transformer_blocks\..+)", r"\1"),)
    comfy_alpha: ClassVar[bool] = False
    example_hub_id: ClassVar[str] = "Lightricks/LTX-2"

    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:Gemma3ForConditionalGeneration",
        "connectors": "diffusers.pipelines.ltx2:LTX2TextConnectors", "vae": "diffusers:AutoencoderKLLTX2Video",
        "audio_vae": "diffusers:AutoencoderKLLTX2Audio", "vocoder": "diffusers.pipelines.ltx2.vocoder:LTX2Vocoder",
        "transformer": "diffusers:LTX2VideoTransformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:LTX2Pipeline", "i2v": "diffusers:LTX2ImageToVideoPipeline"}

    def __init__(self, config: ModelConfig, frame_rate: float):
        super().__init__(config, frame_rate)
        if config.audio:
            self.default_lora_targets = VIDEO_LORA_TARGETS + AUDIO_LORA_TARGETS

    def component_classes(self) -> dict[str, type]:
        """The declared classes, the vocoder's as its config.json names it (LTX-2.3's has bandwidth extension)."""
        classes = super().component_classes()
        if self._vocoder is None:
            from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

            path, subfolder = self.source("vocoder")
            try:
                name = dict(LTX2Vocoder.load_config(path, **({"subfolder": subfolder} if subfolder else {})))
            except (OSError, ValueError) as err:
                raise self.load_error("vocoder", path, err) from err
            if name.get("_class_name") not in VOCODERS:
                raise UserError(f"the vocoder at {path!r} is a {name.get('_class_name')!r}; ltx-2 loads "
                                 f"{' or '.join(VOCODERS)}. Set model.components.vocoder to an LTX-2 vocoder")
            self._vocoder = load_class(VOCODERS[name["_class_name"]])
        classes["vocoder"] = self._vocoder
        return classes

    @functools.cached_property
    def cross_timestep(self) -> bool:
        """diffusers' `use_cross_timestep`: LTX-2.3 (prompt and cross-attention modulation, `cross_attn_mod`)
        modulates each stream's audio-video cross-attention by the other stream's sigma, LTX-2.0 by its own."""
        transformer = self.load_config("transformer")
        return bool(transformer.get("cross_attn_mod") or transformer.get("audio_cross_attn_mod"))

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self._vae_without_weights()
        transformer = self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise UserError(f"LTX-2 transformers with patch_size_t {transformer['patch_size_t']} are not supported; "
                             "expected 1")
        if self.config.task == "i2v":
            self._check_image_latent(vae.config)
        return VaeGeometry(temporal=vae.temporal_compression_ratio, spatial=vae.spatial_compression_ratio,
                           channels=vae.config.latent_channels, patch=transformer.get("patch_size", 1))

    def _check_image_latent(self, vae) -> None:
        """i2v takes the clip's first latent frame as the pipeline's image latent: that needs a causal encoder
        (the first frame encoded alone) and scaling factor 1 (the pipeline normalises the image without it)."""
        where = self.source("vae")[0]
        if not vae.encoder_causal or vae.scaling_factor != 1.0:
            raise UserError(f"model.task = \"i2v\" on ltx-2 needs a causal video VAE encoder with scaling_factor 1 "
                             f"(as Lightricks/LTX-2's): the VAE at {where!r} has encoder_causal {vae.encoder_causal}, "
                             f"scaling_factor {vae.scaling_factor}")

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L)}: the connectors' video
        text embedding of the pipeline's Gemma encoding, L = the spec's max_text_tokens; with model.audio
        also their audio text embedding, "audio_prompt_embeds" (B, L, D audio)."""
        embeds, mask, _, _ = self._encode_prompt(encoders, captions, do_classifier_free_guidance=False)
        connectors = encoders["connectors"]
        padding_side = getattr(encoders["tokenizer"], "padding_side", "left")  # the pipeline's: left
        video, audio, video_mask = connectors(embeds.to(connectors.device, connectors.dtype),
                                              mask.to(connectors.device), padding_side=padding_side)
        out = {"prompt_embeds": video.float(), "prompt_attention_mask": video_mask.float()}
        if self.config.audio:
            out["audio_prompt_embeds"] = audio.float()
        return out

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """The connectors' video text embedding (heads x head dim wide) and its mask."""
        connectors = self.load_config("connectors")
        width = connectors["video_connector_num_attention_heads"] * connectors["video_connector_attention_head_dim"]
        shapes = {"prompt_embeds": (self.max_text_tokens, width), "prompt_attention_mask": (self.max_text_tokens,),
                  "latents": self.latent_shape(bucket)}
        if self.config.audio:  # the audio connector's width; the clip's audio latents
            shapes["audio_prompt_embeds"] = (self.max_text_tokens, connectors["audio_connector_num_attention_heads"]
                                             * connectors["audio_connector_attention_head_dim"])
            shapes["audio_latents"] = self.sound.latent_shape(bucket)
        return shapes

    @torch.no_grad()
    def encode_validation_text(self, encoders, prompt: str) -> dict[str, Tensor]:
        """What LTX2Pipeline's call takes as `prompt_embeds` / `prompt_attention_mask`: Gemma's stacked hidden
        states before the connectors (the pipeline runs its `connectors` itself; they load with it)."""
        return self._prompt_and_mask(encoders, [prompt])

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Latents normalised as LTX2Pipeline denormalises them (posterior mode: stage 1 is deterministic);
        for i2v too: their first frame is the image latent (docs/families.md, LTX-2)."""
        from diffusers import LTX2Pipeline

        self._check_video(video)
        vae = encoders["vae"]
        latents = self._vae_mode(vae, video)
        latents = LTX2Pipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return {"latents": latents.float()}

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """Flow matching on the packed video tokens; video-only: audio cross-attention off; model.audio: the
        audio tokens noised with the same sigma and their terms in `Prediction.audio`; i2v: the first latent
        frame clean, at timestep 0 and out of the loss (docs/families.md, LTX-2)."""
        from diffusers import LTX2Pipeline

        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        frames, height, width = x0.shape[2:]
        patch = self.geometry.patch
        grid = (frames, height // patch, width // patch)
        dtype = input_dtype(transformer)
        i2v = self.config.task == "i2v"
        weight = None
        if i2v:  # the image latent, clean, as the pipeline's prepare_latents puts it there
            noisy = torch.cat([x0[:, :, :1], noisy[:, :, 1:]], dim=2)
            weight = torch.ones(1, 1, frames, 1, 1, device=x0.device)
            weight[:, :, 0] = 0
        tokens = LTX2Pipeline._pack_latents(noisy, patch, 1).to(dtype)
        text = batch["prompt_embeds"].to(tokens.device, dtype)
        mask = batch["prompt_attention_mask"].to(tokens.device)
        timestep = (sigmas * NUM_TRAIN_TIMESTEPS).to(tokens.device)  # float32, as the pipeline passes it
        # i2v: per token, frame-major as the tokens are packed: t * (1 - conditioning mask), 0 on the image
        video_timestep = self.token_timesteps(timestep, grid) if i2v else timestep
        # the audio stream's sigma: the sample's, or its own (model.audio_timesteps = "independent")
        audio_sigmas = batch["audio_sigmas"].to(sigmas) if "audio_sigmas" in batch else sigmas
        audio_timestep = (audio_sigmas * NUM_TRAIN_TIMESTEPS).to(tokens.device)
        audio = (self._audio_inputs(batch, audio_sigmas, mask, dtype) if self.config.audio
                 else self._silent_audio(text, transformer.config.audio_in_channels))
        out, audio_out = transformer(
            hidden_states=tokens, encoder_hidden_states=text, timestep=video_timestep, audio_timestep=audio_timestep,
            sigma=timestep, audio_sigma=audio_timestep, encoder_attention_mask=mask, num_frames=grid[0],
            height=grid[1], width=grid[2], fps=self.frame_rate, return_dict=False, **audio.pop("inputs"))
        prediction = LTX2Pipeline._unpack_latents(out, *grid, patch, 1)
        sound = None
        if self.config.audio:
            x0_audio = audio["x0"]
            sound = Prediction(prediction=LTX2Pipeline._unpack_audio_latents(audio_out, *x0_audio.shape[2:]).float(),
                               target=audio["noise"] - x0_audio, weight=None)
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight, audio=sound)

    @staticmethod
    def _silent_audio(text: Tensor, channels: int) -> dict[str, Any]:
        """Video-only: a one-token zero audio input (the diffusers class needs one) that only runs through the
        audio stream, the cross-attention off (`isolate_modalities`), so the video prediction ignores it."""
        batch_size = text.shape[0]
        return {"inputs": dict(audio_hidden_states=text.new_zeros(batch_size, 1, channels),
                               audio_encoder_hidden_states=text.new_zeros(batch_size, 1, text.shape[-1]),
                               audio_num_frames=1, isolate_modalities=True)}

    def _audio_inputs(self, batch: dict[str, Tensor], sigmas: Tensor, mask: Tensor, dtype) -> dict[str, Any]:
        """model.audio: the audio latents (B, C, L, M) noised with the audio sigmas, packed as LTX2Pipeline
        packs them ((B, L, C x M): every mel bin of a latent frame in one token), with the connectors' audio
        text embedding and the video's text mask (the pipeline passes that mask to both), the audio-video
        cross-attention on, modulated as validation samples (`cross_timestep`)."""
        from diffusers import LTX2Pipeline

        if "audio_noise" not in batch:
            raise UserError("model.audio: the batch has audio_latents but no audio_noise; the trainer draws it "
                             "(train/parallel/batching.py draw_audio_noise)")
        x0 = batch["audio_latents"].float().to(mask.device)
        noise = batch["audio_noise"].to(x0)
        noisy = flow_match_noisy(x0, noise, sigmas)
        inputs = dict(audio_hidden_states=LTX2Pipeline._pack_audio_latents(noisy).to(dtype),
                      audio_encoder_hidden_states=batch["audio_prompt_embeds"].to(mask.device, dtype),
                      audio_encoder_attention_mask=mask, audio_num_frames=x0.shape[2], isolate_modalities=False,
                      use_cross_timestep=self.cross_timestep)
        return {"inputs": inputs, "x0": x0, "noise": noise}

    @staticmethod
    def token_timesteps(timestep: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """LTX2ImageToVideoPipeline's `timestep.unsqueeze(-1) * (1 - conditioning_mask)`: (B, F x H x W), the
        sample's timestep on every token but the first latent frame's, which get 0."""
        frames, height, width = grid
        per_frame = torch.ones(frames, height * width, device=timestep.device)
        per_frame[0] = 0
        return timestep[:, None] * per_frame.flatten()[None]

    def cp_plan(self) -> ContextParallelPlan:
        """Split the packed video tokens and their per-token timesteps (i2v) at the input, gather after proj_out;
        the video self-attention switches to heads (its query/key norms span all heads, its gate logits are per
        head). The rotary tables are the whole grid's: "split" ones are laid out (B, heads, tokens, D / 2),
        "interleaved" ones over all heads' channels; each rank keeps its heads'. The audio stream (short: 25
        tokens a second) stays whole on every rank: its self-attention runs whole, the audio-to-video attention
        (video queries) needs only its queries' rotary table cut to the rank's tokens, and the video-to-audio
        one (audio queries over every video token) takes this rank's heads of the audio queries and of the
        video keys and values over all tokens, then gathers the heads. Video-only runs isolate the audio."""
        split = self.load_config("transformer").get("rope_type", "interleaved") == "split"
        cross = CrossStreamPlan(queries_whole=("video_to_audio_attn",), queries_split=("audio_to_video_attn",),
                                rope_dims=(-2, -3) if split else (-2, -1))
        return ContextParallelPlan(
            split_inputs={"": {"hidden_states": 1, "timestep": 1}}, gather_output="proj_out", self_attention=("attn1",),
            sequence_to_heads=("norm_q", "norm_k", "to_v", "to_gate_logits"),
            rope_heads={"rope": -3 if split else -1}, cross_stream=cross)

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """RoPE's time positions depend on the frame rate: sample at the rate frames were sampled at."""
        return {**super().inference_settings(), "frame_rate": self.frame_rate}

    def pipeline_inputs(self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None,
                        last_image=None) -> dict[str, Any]:
        """Validation samples a checkpoint as diffusers documents it: LTX-2.0's audio-video cross-attention
        modulated by each stream's own timestep (`use_cross_timestep=False`), LTX-2.3's by the other's (True)."""
        return {**super().pipeline_inputs(prompt, bucket, steps, seed, image, last_image),
                "use_cross_timestep": self.cross_timestep}
