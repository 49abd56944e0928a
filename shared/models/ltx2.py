"""LTX-2 (Lightricks, audio + video): Gemma 3 text encoder with text connectors, causal video VAE
(x8 time, x32 space), a DiT with a video and an audio stream joined by cross-attention.

vt trains the video stream only (the audio branch stays out, docs/families.md):
- stage 1 stores what LTX2Pipeline feeds the video stream: Gemma's stacked hidden states of the
  left-padded caption (`encode_prompt`) passed through the frozen `connectors`, i.e. their video
  text embedding and mask (`prompt_embeds`, `prompt_attention_mask`; diffusers' connectors mark
  every row valid, their output fills the padding), plus latents normalised as
  the pipeline denormalises them (`(z - mean) * scaling_factor / std`). With `model.audio` it also
  stores the clip's sound as the audio stream takes it (`encode_audio`): the waveform (16 kHz stereo
  for LTX-2, the audio VAE's `sample_rate` and `in_channels`) as the log-mel spectrogram Lightricks'
  trainer feeds the audio VAE (shared/models/mel.py: n_fft 1024, the VAE's hop and mel bins), the
  posterior mode, its first `audio_latent_shape` frames (the causal encoder gives one more than
  LTX2Pipeline generates for the clip's duration: the last, which only sees the span's last mel frame,
  goes), normalised as the pipeline denormalises audio latents before its audio VAE decodes them
  (packed per frame, `(z - mean) / std`); stored unpacked, (channels, frames, mel bins / 4);
- stage 2 calls the transformer the way Lightricks' own trainer trains video without audio (its
  model takes `audio=None` and skips the audio blocks): `isolate_modalities=True` turns off the
  audio-to-video and video-to-audio cross-attention, so the video prediction depends on the video
  tokens and text alone, and a one-token zero audio input (which the diffusers class requires)
  only runs through the audio stream, whose output is dropped. Flow matching on the packed video
  tokens: timestep 1000 sigma, target noise - x0, RoPE at the bucket frame rate (`fps`, as the
  pipeline's `frame_rate`);
- what trains: LoRA defaults to the video attention (`attn1`, `attn2`: q/k/v/out); a full
  fine-tune trains every parameter except the audio stream and the audio-video cross-attention
  (`full_trainable`), which receive no gradient without audio. Those stay as the checkpoint has
  them, and LTX2Pipeline still generates audio with them in validation (its audio VAE and vocoder
  load frozen, the pipeline needs them to run);
- LoRA files: ComfyUI's (Lightricks') names for the video attention are diffusers' own, so the
  ComfyUI file is `diffusion_model.` + the diffusers module name, scale folded into lora_B
  (diffusers' LTX-2 conversion does not read `.alpha` keys).
Image-to-video (`model.task = "i2v"`, LTX2ImageToVideoPipeline), video stream only as for t2v: the
pipeline puts the image's normalised latent in the first latent frame and keeps it clean (its
conditioning mask gives those tokens timestep 0, and it steps only the other frames). Training does
the same: the causal VAE encodes the clip's first frame alone, so the first latent frame of the
clip's latents is that image latent (stage 1 stores latents only); it stays clean, its tokens get
timestep 0 (the per-token `timestep`; `audio_timestep` and `sigma` stay the sample's), and its loss
weight is 0. The pipeline also re-encodes a still image as H.264 (CRF 33 for LTX-2's Gemma 3) so it
looks like a video frame; a clip's first frame already is one.
No TP or CP plan: both would have to split the audio stream and the audio-video cross-attention too.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.mel import log_mel
from vt.shared.models.spec import AudioFormat, ModelSpec, VaeGeometry
from vt.shared.models.tiny import build_gemma_tokenizer

# Parameters of the audio stream and of the audio <-> video cross-attention: no gradient reaches them
# in video-only training, so a full fine-tune leaves them frozen (and LoRA must not target them).
# The audio VAE's input: its STFT size is Lightricks' (ltx_core's AudioEncoder n_fft, the checkpoint's
# preprocessing.stft.filter_length); diffusers' AutoencoderKLLTX2Audio config does not carry it.
AUDIO_N_FFT = 1024
AUDIO_PARAMETERS = re.compile(r"(^|\.)(audio_|av_cross_attn_|video_to_audio|video_a2v_)|(^|\.)cross_attn_(audio_)?rope")


class LTX2Spec(ModelSpec):
    family: ClassVar[str] = "ltx-2"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "connectors", "vae")
    # Video self- and cross-attention only: suffixes that never match `audio_attn1.to_q` and the like.
    default_lora_targets: ClassVar[list[str]] = [f"{attn}.{proj}" for attn in ("attn1", "attn2")
                                                 for proj in ("to_q", "to_k", "to_v", "to_out.0")]
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ((r"(transformer_blocks\..+)", r"\1"),)
    comfy_alpha: ClassVar[bool] = False
    example_hub_id: ClassVar[str] = "Lightricks/LTX-2"
    audio_stream: ClassVar[bool] = True

    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:Gemma3ForConditionalGeneration",
        "connectors": "diffusers.pipelines.ltx2:LTX2TextConnectors", "vae": "diffusers:AutoencoderKLLTX2Video",
        "audio_vae": "diffusers:AutoencoderKLLTX2Audio", "vocoder": "diffusers.pipelines.ltx2.vocoder:LTX2Vocoder",
        "transformer": "diffusers:LTX2VideoTransformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:LTX2Pipeline", "i2v": "diffusers:LTX2ImageToVideoPipeline"}

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self._vae_without_weights()
        transformer = self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise ValueError(f"LTX-2 transformers with patch_size_t {transformer['patch_size_t']} are not supported; "
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
            raise ValueError(f"model.task = \"i2v\" on ltx-2 needs a causal video VAE encoder with scaling_factor 1 "
                             f"(as Lightricks/LTX-2's): the VAE at {where!r} has encoder_causal {vae.encoder_causal}, "
                             f"scaling_factor {vae.scaling_factor}")

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L)}: the connectors' video
        text embedding of the pipeline's Gemma encoding, L = the spec's max_text_tokens."""
        embeds, mask, _, _ = self._encode_prompt(encoders, captions, do_classifier_free_guidance=False)
        connectors = encoders["connectors"]
        padding_side = getattr(encoders["tokenizer"], "padding_side", "left")  # the pipeline's: left
        video, _audio, video_mask = connectors(embeds.to(connectors.device, connectors.dtype),
                                               mask.to(connectors.device), padding_side=padding_side)
        return {"prompt_embeds": video.float(), "prompt_attention_mask": video_mask.float()}

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """The connectors' video text embedding (heads x head dim wide) and its mask."""
        connectors = self.load_config("connectors")
        width = connectors["video_connector_num_attention_heads"] * connectors["video_connector_attention_head_dim"]
        shapes = {"prompt_embeds": (self.max_text_tokens, width), "prompt_attention_mask": (self.max_text_tokens,),
                  "latents": self.latent_shape(bucket)}
        if self.config.audio:
            shapes["audio_latents"] = self.audio_latent_shape(bucket)
        return shapes

    @torch.no_grad()
    def encode_validation_text(self, encoders, prompt: str) -> dict[str, Tensor]:
        """What LTX2Pipeline's call takes as `prompt_embeds` / `prompt_attention_mask`: Gemma's stacked hidden
        states before the connectors (the pipeline runs its `connectors` itself; they load with it)."""
        embeds, mask, _, _ = self._encode_prompt(encoders, [prompt], do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float()}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Latents normalised as LTX2Pipeline denormalises them (posterior mode: stage 1 is deterministic);
        for i2v too: their first frame is the image latent (module docstring)."""
        from diffusers import LTX2Pipeline

        self._check_video(video)
        vae = encoders["vae"]
        latents = self._vae_mode(vae, video)
        latents = LTX2Pipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return {"latents": latents.float()}

    def audio_format(self) -> AudioFormat:
        """The audio VAE's sample rate and spectrogram channels (stereo for LTX-2)."""
        config = self.load_config("audio_vae")
        return AudioFormat(sample_rate=config["sample_rate"], channels=config["in_channels"])

    def audio_latent_shape(self, bucket: Bucket) -> tuple[int, int, int]:
        """(latent channels, frames, mel bins / 4): what LTX2Pipeline generates for `bucket.frames` frames at the
        spec's frame rate (its `audio_num_frames`: the duration x sample rate / hop / 4, rounded)."""
        from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR as DOWN

        config = self.load_config("audio_vae")
        per_second = config["sample_rate"] / config["mel_hop_length"] / float(DOWN)
        return config["latent_channels"], round(bucket.frames / self.frame_rate * per_second), config["mel_bins"] // DOWN

    @torch.no_grad()
    def encode_audio(self, encoders, audio: Tensor) -> dict[str, Tensor]:
        """{"audio_latents": (B, C, frames, mel bins / 4)} float32: the log-mel of `audio`, the audio VAE's
        posterior mode cut to the pipeline's length, normalised as LTX2Pipeline denormalises (module docstring)."""
        from diffusers import LTX2Pipeline

        vae = encoders["audio_vae"]
        config = vae.config
        mel = log_mel(audio.to(vae.device, torch.float32), config.sample_rate, AUDIO_N_FFT, config.mel_hop_length,
                      config.mel_bins)
        latents = vae.encode(mel.to(vae.dtype)).latent_dist.mode().float()
        frames = round(audio.shape[-1] / config.mel_hop_length / vae.temporal_compression_ratio)  # the duration's
        if latents.shape[2] < frames:
            raise ValueError(f"the LTX-2 audio VAE encoded {audio.shape[-1]} samples into {latents.shape[2]} latent "
                             f"frames, fewer than the {frames} LTX2Pipeline generates for that duration")
        latents = latents[:, :, :frames]
        packed = LTX2Pipeline._pack_audio_latents(latents)  # (B, frames, C x bins): the statistics' layout
        packed = LTX2Pipeline._normalize_audio_latents(packed, vae.latents_mean.float(), vae.latents_std.float())
        return {"audio_latents": LTX2Pipeline._unpack_audio_latents(packed, frames, latents.shape[3]).float()}

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generator: torch.Generator | None = None) -> Prediction:
        """Flow matching on the packed video tokens, audio cross-attention off; i2v: the first latent frame
        clean, at timestep 0 and out of the loss (see the module docstring)."""
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
        batch_size = tokens.shape[0]
        timestep = (sigmas * NUM_TRAIN_TIMESTEPS).to(tokens.device)  # float32, as the pipeline passes it
        # i2v: per token, frame-major as the tokens are packed: t * (1 - conditioning mask), 0 on the image
        video_timestep = self.token_timesteps(timestep, grid) if i2v else timestep
        out = transformer(
            hidden_states=tokens,
            audio_hidden_states=tokens.new_zeros(batch_size, 1, transformer.config.audio_in_channels),
            encoder_hidden_states=text,
            audio_encoder_hidden_states=text.new_zeros(batch_size, 1, text.shape[-1]),
            timestep=video_timestep, audio_timestep=timestep, sigma=timestep,
            encoder_attention_mask=batch["prompt_attention_mask"].to(tokens.device),
            num_frames=grid[0], height=grid[1], width=grid[2], fps=self.frame_rate, audio_num_frames=1,
            isolate_modalities=True,  # no audio <-> video cross-attention: the video stream alone
            return_dict=False,
        )[0]
        prediction = LTX2Pipeline._unpack_latents(out, *grid, patch, 1)
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)

    @staticmethod
    def token_timesteps(timestep: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """LTX2ImageToVideoPipeline's `timestep.unsqueeze(-1) * (1 - conditioning_mask)`: (B, F x H x W), the
        sample's timestep on every token but the first latent frame's, which get 0."""
        frames, height, width = grid
        per_frame = torch.ones(frames, height * width, device=timestep.device)
        per_frame[0] = 0
        return timestep[:, None] * per_frame.flatten()[None]

    def full_trainable(self, transformer) -> None:
        """A full fine-tune trains the video stream: the audio stream and the audio-video cross-attention
        get no gradient without audio, so they stay frozen (DDP would otherwise wait for their gradients)."""
        for name, param in transformer.named_parameters():
            param.requires_grad_(not AUDIO_PARAMETERS.search(name))

    def check_lora(self, transformer, targets) -> None:
        """Targets that reach the audio stream are refused: video-only training never trains them."""
        audio = sorted({n.split(".lora_")[0] for n, _ in transformer.named_parameters()
                        if "lora_" in n and AUDIO_PARAMETERS.search(n)})
        if audio:
            raise ValueError(f"train.lora_targets {targets} reach the audio stream ({audio[0]}, ...), which vt does "
                             "not train for ltx-2 (video only); name video modules, e.g. \"attn1.to_q\" or "
                             "\"ff.net.2\" (suffixes), or leave train.lora_targets unset")

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """RoPE's time positions depend on the frame rate: sample at the rate frames were sampled at."""
        return {**super().inference_settings(), "frame_rate": self.frame_rate}

    def pipeline_inputs(self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None,
                        last_image=None) -> dict[str, Any]:
        """Validation samples an LTX-2 (2.0) checkpoint as diffusers documents it: audio-video cross-attention
        modulated by each stream's own timestep (`use_cross_timestep=False`; True is LTX-2.3's)."""
        return {**super().pipeline_inputs(prompt, bucket, steps, seed, image, last_image), "use_cross_timestep": False}

    # ----------------------------------------------------------------------------- tiny preset
    @classmethod
    def tiny_parts(cls, task: str) -> dict[str, Any]:
        """diffusers' test sizes for the transformer (2 layers, video 2 heads x 8, audio 2 x 4), text
        connectors and vocoder; the audio VAE at diffusers' test widths but with LTX-2's three levels (its
        encoder downsamples x4 in time and mel bins, as the pipeline's audio latent shape assumes); a
        4-level video VAE (x8 time, x32 space, 8 channels); a
        2-layer Gemma 3 with a locally built tokenizer; one preset for both tasks, saved in LTX2Pipeline's
        layout or (i2v) LTX2ImageToVideoPipeline's."""
        from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                               LTX2VideoTransformer3DModel)
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

        tokenizer = build_gemma_tokenizer()
        text_hidden = 16
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=Gemma3TextConfig(
                vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=16,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id),
            vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4))
        connectors = LTX2TextConnectors(  # each connector's width (heads x head dim) is the text width
            caption_channels=text_hidden, text_proj_in_factor=2 + 1, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=8, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32,
            rope_double_precision=False, rope_type="split")
        vae = AutoencoderKLLTX2Video(
            latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 16, 32),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), patch_size=4,
            patch_size_t=1, decoder_inject_noise=(False,) * 4, spatial_compression_ratio=32,
            temporal_compression_ratio=8)
        # Non-trivial normalisation statistics, so a wrong normalisation cannot go unnoticed.
        vae.latents_mean.copy_(torch.randn(8) * 0.1)
        vae.latents_std.copy_(torch.rand(8) + 0.5)
        transformer = LTX2VideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
            attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
            audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
            qk_norm="rms_norm_across_heads", caption_channels=text_hidden, rope_double_precision=False,
            rope_type="split")
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None,
            in_channels=2, resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height",
            dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
            mel_bins=8)
        audio_vae.latents_mean.copy_(torch.randn(4) * 0.1)  # per (channel, mel bin) of a latent frame, as for video
        audio_vae.latents_std.copy_(torch.rand(4) + 0.5)
        vocoder = LTX2Vocoder(
            in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
        scheduler = FlowMatchEulerDiscreteScheduler(  # LTX's token-count shift (LTX2Pipeline's mu defaults)
            use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
            max_image_seq_len=4096, shift_terminal=0.1)
        return dict(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer,
                    connectors=connectors, transformer=transformer, vocoder=vocoder)
