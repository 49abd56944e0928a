"""Kandinsky 5.0 video (Kandinsky Lab, text- and image-to-video): Qwen2.5-VL + CLIP text encoders, HunyuanVideo's
VAE, a DiT of text then visual blocks, channel-last latents. Particulars and why: docs/families.md, "Kandinsky 5"."""

from __future__ import annotations

import inspect
import logging
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.hunyuan_video import PooledTextAndFirstFrame
from vt.shared.models.kandinsky5_conditions import caption_lengths, channel_last, image_latents
from vt.shared.models.lora import lora_weight_name
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan, Unplanned
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.weights import comfy

PROMPT_TEMPLATE_TOKENS = 128  # Kandinsky5T2VPipeline.prompt_template_encode_start_idx: template tokens cropped
PIPELINE_TEXT_LIMIT = 1024  # the pipeline's check_inputs limit (the text RoPE table has 1024 positions)
NABLA_GROUP = 8  # NABLA's fractal flattening groups 8 x 8 tokens
I2V_NORMALISED_FRAMES = 4  # Kandinsky5I2VPipeline.normalize_first_frame rescales these latent frames by the next
_WARNED: set[str] = set()  # buckets the i2v validation warning was given for
log = logging.getLogger(__name__)
NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, "
    "ugly, deformed, walking backwards"
)  # what Kandinsky 5's and 6's pipelines encode for None


class Kandinsky5Spec(PooledTextAndFirstFrame, ModelSpec):
    family: ClassVar[str] = "kandinsky5"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("text_transformer_blocks", "visual_transformer_blocks")
    pipeline_refusal: ClassVar[str] = (
        "its visual blocks take the visual tokens and, beside them, the text blocks' output, so the last text block's "
        "output is not the next block's input, which is what a pipeline stage hands on"
    )
    example_hub_id: ClassVar[str] = "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers"
    negative_prompt: ClassVar[str] = NEGATIVE_PROMPT
    # Attention q/k/v/out of every block (`out_layer` alone would reach the FFNs, modulations and output layer too).
    default_lora_targets: ClassVar[list[str]] = [
        "to_query",
        "to_key",
        "to_value",
        "self_attention.out_layer",
        "cross_attention.out_layer",
    ]
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ((r"((?:text|visual)_transformer_blocks\.\d+\..+)", r"\1"),)
    comfy_alpha: ClassVar[bool] = False  # the scale goes into lora_B: ComfyUI and `load_lora` then apply 1
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration",
        "text_encoder_2": "transformers:CLIPTextModel",
        "vae": "diffusers:AutoencoderKLHunyuanVideo",
        "transformer": "diffusers:Kandinsky5Transformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = {
        "t2v": "diffusers:Kandinsky5T2VPipeline",
        "i2v": "diffusers:Kandinsky5I2VPipeline",
    }

    def __init__(self, config: ModelConfig, frame_rate: float):
        super().__init__(config, frame_rate)
        if self.max_text_tokens > PIPELINE_TEXT_LIMIT:
            raise UserError(
                f"model.max_text_tokens = {self.max_text_tokens}, but {self.pipeline_class().__name__} "
                f"takes at most {PIPELINE_TEXT_LIMIT} text tokens (its text RoPE table); set it to "
                f"{PIPELINE_TEXT_LIMIT} or less, or unset it (512, the pipeline's default)"
            )

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        patch = tuple(transformer.get("patch_size", (1, 2, 2)))
        if patch != (1, 2, 2):  # the pipelines' RoPE positions divide the latent sides by 2, frames by 1
            raise UserError(f"Kandinsky 5 transformers with patch_size {patch} are not supported; expected (1, 2, 2)")
        if transformer.get("in_visual_dim") != vae["latent_channels"]:
            raise UserError(
                f"the Kandinsky 5 transformer takes {transformer.get('in_visual_dim')} latent channels, "
                f"the VAE makes {vae['latent_channels']}: check model.components"
            )
        return VaeGeometry(
            temporal=vae.get("temporal_compression_ratio", 4),
            spatial=vae.get("spatial_compression_ratio", 8),
            channels=vae["latent_channels"],
            patch=2,
        )

    @cached_property
    def sparse_attention(self) -> bool:
        return self.load_config("transformer").get("attention_type") == "nabla"

    def check_bucket(self, bucket: Bucket) -> None:
        super().check_bucket(bucket)
        unit = self.geometry.spatial * self.geometry.patch * NABLA_GROUP
        for side, value in (("height", bucket.height), ("width", bucket.width)):
            if self.sparse_attention and value % unit:
                raise UserError(
                    f"bucket {bucket.name}: this {self.family} transformer uses NABLA sparse attention "
                    f'(attention_type "nabla"), which groups 8 x 8 tokens: {side} must be a multiple of '
                    f"{unit}; change buckets.sizes (e.g. {max(unit, value // unit * unit)})"
                )

    @cached_property
    def _rules(self):
        """The family pipeline without parts: its own rules (template, RoPE scale, sparse attention) to call."""
        cls = self.pipeline_class()
        return cls(**{name: None for name in list(inspect.signature(cls.__init__).parameters)[1:]})

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """Each caption encoded alone, as the pipeline encodes one prompt: its rows first, zeros after them."""
        pipeline, device, length = self._text_pipeline(encoders), encoders["text_encoder"].device, self.max_text_tokens
        texts = [
            pipeline.encode_prompt([caption], max_sequence_length=length, device=device, dtype=torch.float32)[:2]
            for caption in captions
        ]
        rows = torch.tensor([qwen.shape[1] for qwen, _ in texts], device=device)
        embeds = [F.pad(qwen[0].float(), (0, 0, 0, length - len(qwen[0]))) for qwen, _ in texts]
        return {
            "prompt_embeds": torch.stack(embeds),
            "prompt_attention_mask": (torch.arange(length, device=device) < rows[:, None]).float(),
            "pooled_prompt_embeds": torch.stack([clip[0] for _, clip in texts]).float(),
        }

    @torch.no_grad()
    def encode_validation_text(self, encoders, prompt: str) -> dict[str, Tensor]:
        """What the pipeline's encode_prompt returns: Qwen's rows unpadded, CLIP's, `prompt_cu_seqlens` [0, n]."""
        stored = self.encode_text(encoders, [prompt])
        rows = int(stored["prompt_attention_mask"].sum())
        return {
            "prompt_embeds_qwen": stored["prompt_embeds"][:, :rows],
            "prompt_embeds_clip": stored["pooled_prompt_embeds"],
            "prompt_cu_seqlens": torch.tensor([0, rows], dtype=torch.int32),
        }

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """The pipeline's transformer call for one prompt, once per sample with its own text rows (docs/families.md)."""
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        weight = None
        if self.frame_conditions:  # the first latent frame: the clean image latents, weight 0 in the loss
            noisy = torch.cat([image_latents(batch, self.frame_conditions).to(noisy), noisy[:, :, 1:]], dim=2)
            weight = noisy.new_ones(noisy.shape[0], 1, noisy.shape[2], 1, 1)
            weight[:, :, 0] = 0.0
        dtype, g, device = input_dtype(transformer), self.geometry, x0.device
        hidden = channel_last(transformer, noisy, 0 if self.frame_conditions else None).to(dtype)
        _, frames, height, width, _ = hidden.shape
        shared = dict(  # as the pipeline: RoPE positions, its resolution rule, its sparse attention
            visual_rope_pos=[torch.arange(n, device=device) for n in (frames, height // g.patch, width // g.patch)],
            scale_factor=self._rules._get_scale_factor(height * g.spatial, width * g.spatial),
            sparse_params=self._sparse_params(transformer, hidden),
            return_dict=False,
        )
        timestep = (sigmas * NUM_TRAIN_TIMESTEPS).to(dtype)  # the pipeline's timestep, in the transformer's dtype
        outputs = []
        for row, length in enumerate(caption_lengths(batch["prompt_attention_mask"])):
            one = slice(row, row + 1)
            outputs.append(
                transformer(
                    hidden_states=hidden[one],
                    timestep=timestep[one],
                    encoder_hidden_states=batch["prompt_embeds"][one, :length].to(device, dtype),
                    pooled_projections=batch["pooled_prompt_embeds"][one].to(device, dtype),
                    text_rope_pos=torch.arange(length, device=device),
                    **shared,
                )
            )  # return_dict=False: the tensor
        prediction = torch.cat(outputs)
        return Prediction(prediction=prediction.permute(0, 4, 1, 2, 3).float(), target=noise - x0, weight=weight)

    def _sparse_params(self, transformer, hidden: Tensor) -> dict[str, Any] | None:
        """The pipeline's own `get_sparse_params` for this input (None unless the config says "nabla")."""
        if transformer.config.attention_type != "nabla":
            return None
        backends = {
            getattr(m.processor, "_attention_backend", None)
            for m in transformer.modules()
            if hasattr(m, "to_query") and hasattr(m, "processor")
        }
        if {getattr(b, "value", b) for b in backends} != {"flex"}:
            raise UserError(
                f'this {self.family} transformer uses NABLA sparse attention (attention_type "nabla"), '
                'whose block mask only FlexAttention runs: set train.attention_backend = "flex" (and '
                "validation.attention_backend, if set) and parallel.compile = true on a CUDA GPU"
            )
        rules = SimpleNamespace(transformer=transformer, fast_sta_nabla=self._rules.fast_sta_nabla)
        return type(self._rules).get_sparse_params(rules, hidden, hidden.device)

    def build_pipeline(self, transformer, *args, **kwargs):
        """i2v: the VAE in the transformer's dtype, in which Kandinsky5I2VPipeline hands it the image."""
        pipeline = super().build_pipeline(transformer, *args, **kwargs)
        vae = getattr(pipeline, "vae", None)
        if self.frame_conditions and vae is not None and vae.dtype != pipeline.transformer.dtype:
            vae.to(pipeline.transformer.dtype)
        return pipeline

    def pipeline_inputs(self, prompt: str, bucket: Bucket, *args, **kwargs) -> dict[str, Any]:
        """Warns (once per bucket) where i2v's first-frame normalisation has no later frames to read (NaN video)."""
        latent_frames = self.latent_shape(bucket)[1]
        if self.frame_conditions and latent_frames <= I2V_NORMALISED_FRAMES and bucket.name not in _WARNED:
            _WARNED.add(bucket.name)
            log.warning(
                "%s i2v validation at %s: Kandinsky5I2VPipeline normalises the first %d latent frames "
                "against the later ones, and %d latent frames leave none (NaN video); validate at %d+ "
                "frames",
                self.family,
                bucket.name,
                I2V_NORMALISED_FRAMES,
                latent_frames,
                I2V_NORMALISED_FRAMES * self.geometry.temporal + 1,
            )
        return super().pipeline_inputs(prompt, bucket, *args, **kwargs)

    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """A ComfyUI file (`diffusion_model.` keys, which `load_lora_weights` skips) is renamed, `.alpha` folded in."""
        from safetensors.torch import load_file

        state = load_file(str(Path(folder) / (weight_name or lora_weight_name(expert))))
        if not state or not all(key.startswith(comfy.PREFIX) for key in state):
            return super().load_lora(pipeline, folder, weight_name, expert)
        renamed = {}
        for key, value in state.items():
            module, _, kind = key[len(comfy.PREFIX) :].partition(".lora_")
            if kind == "B.weight" and f"{comfy.PREFIX}{module}.alpha" in state:
                value = value * state[f"{comfy.PREFIX}{module}.alpha"] / value.shape[1]
            if kind:
                renamed[f"transformer.{module}.lora_{kind}"] = value
        pipeline.load_lora_weights(renamed)

    def tp_plan(self) -> TensorParallelPlan:
        attention = ("self_attention", "cross_attention")
        return TensorParallelPlan(
            colwise=(
                *(f"{a}.{p}" for a in attention for p in ("to_query", "to_key", "to_value")),
                "feed_forward.in_layer",
            ),
            rowwise=(*(f"{a}.out_layer" for a in attention), "feed_forward.out_layer"),
            attention=attention,
            heads_attribute="num_heads",
            optional=("cross_attention",),
        )

    def cp_plan(self) -> ContextParallelPlan:
        if self.sparse_attention:
            raise Unplanned(
                f'{self.family} with NABLA sparse attention (attention_type "nabla") has no CP plan '
                "(its FlexAttention block mask under Ulysses is not checked); set parallel.cp = 1"
            )
        last = int(self.load_config("transformer")["num_visual_blocks"]) - 1
        return ContextParallelPlan(
            split_inputs={"visual_transformer_blocks.0": {"visual_embed": 1}},
            gather_output=f"visual_transformer_blocks.{last}",
            self_attention=("self_attention",),
            sequence_to_heads=("to_query", "to_key", "to_value"),
            heads_to_sequence="out_layer",
            block_lists=("visual_transformer_blocks",),
            heads_attribute="num_heads",
        )
