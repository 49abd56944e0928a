"""Kandinsky 5.0 video (Kandinsky Lab, text- and image-to-video; Lite 2B and Pro 19B differ in config only):
Qwen2.5-VL + CLIP text encoders, HunyuanVideo's causal VAE (x4 time, x8 space), a DiT of text blocks then
visual blocks (cross-attention to the text), patch (1, 2, 2), channel-last latents.

What is particular to it, and why: docs/families.md, "Kandinsky 5".
"""

from __future__ import annotations

import inspect
import logging
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.errors import UserError
from vt.shared.models import comfy
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.kandinsky5_conditions import caption_lengths, pooled_and_image_shapes, with_image_latents
from vt.shared.models.lora import lora_weight_name
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan, Unplanned
from vt.shared.models.spec import ModelSpec, VaeGeometry

PROMPT_TEMPLATE_TOKENS = 128  # Kandinsky5T2VPipeline.prompt_template_encode_start_idx: template tokens cropped
PIPELINE_TEXT_LIMIT = 1024  # the pipeline's check_inputs limit (the text RoPE table has 1024 positions)
NABLA_GROUP = 8  # NABLA's fractal flattening groups 8 x 8 tokens
I2V_NORMALISED_FRAMES = 4  # Kandinsky5I2VPipeline.normalize_first_frame rescales these latent frames by the next
_WARNED: set[str] = set()  # buckets the i2v validation warning was given for
log = logging.getLogger(__name__)
NEGATIVE_PROMPT = ("Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, "
                   "ugly, deformed, walking backwards")  # what both pipelines encode for negative_prompt=None


class Kandinsky5Spec(ModelSpec):
    family: ClassVar[str] = "kandinsky5"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    # Text blocks run first, then the visual blocks: FSDP keeps the last visual block gathered for backward.
    block_lists: ClassVar[tuple[str, ...]] = ("text_transformer_blocks", "visual_transformer_blocks")
    pipeline_refusal: ClassVar[str] = (
        "its visual blocks take the visual tokens and, beside them, the text blocks' output, so the last text block's "
        "output is not the next block's input, which is what a pipeline stage hands on")
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2",
                                                    "vae")
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # rows past it never fed
    example_hub_id: ClassVar[str] = "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers"
    negative_prompt: ClassVar[str] = NEGATIVE_PROMPT
    # Attention q/k/v/out of every block (peft matches by suffix: `out_layer` alone would reach the FFNs,
    # modulations and the output layer too).
    default_lora_targets: ClassVar[list[str]] = ["to_query", "to_key", "to_value", "self_attention.out_layer",
                                                 "cross_attention.out_layer"]
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ((r"((?:text|visual)_transformer_blocks\.\d+\..+)",
                                                              r"\1"),)
    comfy_alpha: ClassVar[bool] = False  # the scale goes into lora_B: ComfyUI and `load_lora` then apply 1

    components: ClassVar[dict[str, str]] = {"text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration",
                                            "text_encoder_2": "transformers:CLIPTextModel",
                                            "vae": "diffusers:AutoencoderKLHunyuanVideo",
                                            "transformer": "diffusers:Kandinsky5Transformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:Kandinsky5T2VPipeline",
                                           "i2v": "diffusers:Kandinsky5I2VPipeline"}

    def __init__(self, config: ModelConfig, frame_rate: float):
        super().__init__(config, frame_rate)
        if self.max_text_tokens > PIPELINE_TEXT_LIMIT:
            raise UserError(f"model.max_text_tokens = {self.max_text_tokens}, but {self.pipeline_class().__name__} "
                             f"takes at most {PIPELINE_TEXT_LIMIT} text tokens (its text RoPE table); set it to "
                             f"{PIPELINE_TEXT_LIMIT} or less, or unset it (512, the pipeline's default)")

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        patch = tuple(transformer.get("patch_size", (1, 2, 2)))
        if patch != (1, 2, 2):  # the pipelines' RoPE positions divide the latent sides by 2, frames by 1
            raise UserError(f"Kandinsky 5 transformers with patch_size {patch} are not supported; expected (1, 2, 2)")
        if transformer.get("in_visual_dim") != vae["latent_channels"]:
            raise UserError(f"the Kandinsky 5 transformer takes {transformer.get('in_visual_dim')} latent channels, "
                             f"the VAE makes {vae['latent_channels']}: check model.components")
        return VaeGeometry(temporal=vae.get("temporal_compression_ratio", 4),
                           spatial=vae.get("spatial_compression_ratio", 8), channels=vae["latent_channels"], patch=2)

    @cached_property
    def sparse_attention(self) -> bool:
        """Whether the transformer's config asks for NABLA sparse attention (the pipeline then builds it)."""
        return self.load_config("transformer").get("attention_type") == "nabla"

    def check_bucket(self, bucket: Bucket) -> None:
        """As the base; NABLA also needs latent sides (after the patch) in whole groups of 8 x 8 tokens."""
        super().check_bucket(bucket)
        if not self.sparse_attention:
            return
        unit = self.geometry.spatial * self.geometry.patch * NABLA_GROUP
        for side, value in (("height", bucket.height), ("width", bucket.width)):
            if value % unit:
                raise UserError(f"bucket {bucket.name}: this {self.family} transformer uses NABLA sparse attention "
                                 f"(attention_type \"nabla\"), which groups 8 x 8 tokens: {side} must be a multiple of "
                                 f"{unit}; change buckets.sizes (e.g. {max(unit, value // unit * unit)})")

    @cached_property
    def _rules(self):
        """The family pipeline without parts: its own rules (template, RoPE scale, sparse attention) to call."""
        cls = self.pipeline_class()
        return cls(**{name: None for name in list(inspect.signature(cls.__init__).parameters)[1:]})

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L), "pooled_prompt_embeds": (B, P)},
        L = the spec's max_text_tokens: each caption encoded alone, as the pipeline encodes one prompt, its
        rows first and zeros after them."""
        pipeline = self._text_pipeline(encoders)
        device = encoders["text_encoder"].device
        embeds, mask, pooled = [], torch.zeros(len(captions), self.max_text_tokens, device=device), []
        for row, caption in enumerate(captions):
            qwen, clip, _ = pipeline.encode_prompt([caption], max_sequence_length=self.max_text_tokens, device=device,
                                                   dtype=torch.float32)
            padded = qwen.new_zeros(self.max_text_tokens, qwen.shape[-1])
            padded[:qwen.shape[1]] = qwen[0]
            mask[row, :qwen.shape[1]] = 1
            embeds.append(padded)
            pooled.append(clip[0])
        return {"prompt_embeds": torch.stack(embeds).float(), "prompt_attention_mask": mask,
                "pooled_prompt_embeds": torch.stack(pooled).float()}

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """Qwen's text and its mask, CLIP's pooled embedding; i2v the first frame's latents."""
        return pooled_and_image_shapes(self, super().condition_shapes(bucket))

    @torch.no_grad()
    def encode_validation_text(self, encoders, prompt: str) -> dict[str, Tensor]:
        """The pipeline call's `prompt_embeds_qwen` (1, n, D) unpadded, `prompt_embeds_clip` and
        `prompt_cu_seqlens` ([0, n]): what its own encode_prompt returns for the prompt."""
        stored = self.encode_text(encoders, [prompt])
        rows = int(stored["prompt_attention_mask"].sum())
        return {"prompt_embeds_qwen": stored["prompt_embeds"][:, :rows],
                "prompt_embeds_clip": stored["pooled_prompt_embeds"],
                "prompt_cu_seqlens": torch.tensor([0, rows], dtype=torch.int32)}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """{"latents": mode x scaling_factor}; i2v adds `image_latents`, the first frame encoded alone (the
        VAE's group norms span all frames, so the clip's first latent frame is not the image's)."""
        return with_image_latents(self, encoders, video, super().encode_video(encoders, video))

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """The pipeline's transformer call for one prompt, once per sample with its own text rows, stacked
        back as (B, C, F, H, W). One call per sample, not per caption length: each sample's prediction then
        is the same computation in every data-parallel slicing (the attention rounds q and k to bfloat16,
        so a call over two samples may round a few elements unlike two calls over one)."""
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        weight = None
        if self.config.task == "i2v":
            noisy, weight = self._condition_first_frame(batch, noisy)
        dtype = input_dtype(transformer)
        hidden = self._visual_input(transformer, noisy).to(dtype)
        _, frames, height, width, _ = hidden.shape
        g, device = self.geometry, x0.device
        shared = dict(  # as the pipeline: RoPE positions, its resolution rule, its sparse attention
            visual_rope_pos=[torch.arange(n, device=device) for n in (frames, height // g.patch, width // g.patch)],
            scale_factor=self._rules._get_scale_factor(height * g.spatial, width * g.spatial),
            sparse_params=self._sparse_params(transformer, hidden), return_dict=False)
        timestep = (sigmas * NUM_TRAIN_TIMESTEPS).to(dtype)  # the pipeline's timestep, in the transformer's dtype
        outputs = []
        for row, length in enumerate(caption_lengths(batch["prompt_attention_mask"])):
            one = slice(row, row + 1)
            outputs.append(transformer(
                hidden_states=hidden[one], timestep=timestep[one],
                encoder_hidden_states=batch["prompt_embeds"][one, :length].to(device, dtype),
                pooled_projections=batch["pooled_prompt_embeds"][one].to(device, dtype),
                text_rope_pos=torch.arange(length, device=device), **shared))  # return_dict=False: the tensor
        prediction = torch.cat(outputs)
        return Prediction(prediction=prediction.permute(0, 4, 1, 2, 3).float(), target=noise - x0, weight=weight)

    def _condition_first_frame(self, batch, noisy: Tensor) -> tuple[Tensor, Tensor]:
        """The first latent frame becomes the clean image latents, left out of the loss (weight 0)."""
        if "image_latents" not in batch:
            raise KeyError("task i2v needs batch['image_latents']; precompute the shards with model.task = \"i2v\"")
        noisy = torch.cat([batch["image_latents"].to(noisy), noisy[:, :, 1:]], dim=2)
        weight = noisy.new_ones(noisy.shape[0], 1, noisy.shape[2], 1, 1)
        weight[:, :, 0] = 0.0
        return noisy, weight

    def _visual_input(self, transformer, latents: Tensor) -> Tensor:
        """(B, C, F, H, W) -> the pipelines' channel-last input: with `visual_cond`, [latents, zeros, mask]
        (mask 1 on the first frame for i2v, 0 everywhere for t2v)."""
        latents = latents.permute(0, 2, 3, 4, 1)
        if not transformer.config.visual_cond:
            return latents
        mask = latents.new_zeros(*latents.shape[:-1], 1)
        if self.config.task == "i2v":
            mask[:, 0] = 1.0
        return torch.cat([latents, torch.zeros_like(latents), mask], dim=-1)

    def _sparse_params(self, transformer, hidden: Tensor) -> dict[str, Any] | None:
        """The pipeline's own `get_sparse_params` for this input (None unless the config says "nabla")."""
        if transformer.config.attention_type != "nabla":
            return None
        backends = {getattr(m.processor, "_attention_backend", None) for m in transformer.modules()
                    if hasattr(m, "to_query") and hasattr(m, "processor")}
        if {getattr(b, "value", b) for b in backends} != {"flex"}:
            raise UserError(f"this {self.family} transformer uses NABLA sparse attention (attention_type \"nabla\"), "
                             "whose block mask only FlexAttention runs: set train.attention_backend = \"flex\" (and "
                             "train.validation_attention_backend, if set) and parallel.compile = true on a CUDA GPU")
        rules = SimpleNamespace(transformer=transformer, fast_sta_nabla=self._rules.fast_sta_nabla)
        return type(self._rules).get_sparse_params(rules, hidden, hidden.device)

    # ----------------------------------------------------------------------------- validation
    def build_pipeline(self, transformer, *args, **kwargs):
        """As the base; for i2v the VAE in the transformer's dtype: Kandinsky5I2VPipeline casts the image to
        the transformer's dtype before encoding it (a CPU run keeps the VAE in float32 and a bf16 transformer)."""
        pipeline = super().build_pipeline(transformer, *args, **kwargs)
        vae = getattr(pipeline, "vae", None)
        if self.config.task == "i2v" and vae is not None and vae.dtype != pipeline.transformer.dtype:
            vae.to(pipeline.transformer.dtype)
        return pipeline

    def pipeline_inputs(self, prompt: str, bucket: Bucket, *args, **kwargs) -> dict[str, Any]:
        """As the base; warns (once per bucket) where Kandinsky5I2VPipeline's first-frame normalisation
        (`normalize_first_frame`: the first 4 latent frames rescaled to the statistics of the next ones)
        has no later frames to read and turns the video into NaN: i2v validation needs 17 frames or more."""
        latent_frames = self.latent_shape(bucket)[1]
        if self.config.task == "i2v" and latent_frames <= I2V_NORMALISED_FRAMES and bucket.name not in _WARNED:
            _WARNED.add(bucket.name)
            log.warning("%s i2v validation at %s: Kandinsky5I2VPipeline normalises the first %d latent frames "
                        "against the later ones, and %d latent frames leave none (NaN video); validate at %d+ "
                        "frames", self.family, bucket.name, I2V_NORMALISED_FRAMES, latent_frames,
                        I2V_NORMALISED_FRAMES * self.geometry.temporal + 1)
        return super().pipeline_inputs(prompt, bucket, *args, **kwargs)

    # ----------------------------------------------------------------------------- export
    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """The pipeline's `load_lora_weights`; a ComfyUI file (`diffusion_model.` keys, which that loader
        skips) is renamed to the diffusers keys first, its `.alpha` scales (other writers') folded in."""
        from safetensors.torch import load_file

        path = Path(folder) / (weight_name or lora_weight_name(expert))
        state = load_file(str(path))
        if not state or not all(key.startswith(comfy.PREFIX) for key in state):
            return super().load_lora(pipeline, folder, weight_name, expert)
        renamed = {}
        for key, value in state.items():
            module, _, kind = key[len(comfy.PREFIX):].partition(".lora_")
            if kind == "B.weight" and f"{comfy.PREFIX}{module}.alpha" in state:
                value = value * state[f"{comfy.PREFIX}{module}.alpha"] / value.shape[1]
            if kind:
                renamed[f"transformer.{module}.lora_{kind}"] = value
        pipeline.load_lora_weights(renamed)

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> TensorParallelPlan:
        """Every attention's q/k/v and FFN input column-wise, their outputs row-wise, in text and visual blocks (q/k
        norms and rotary tables span one head; the modulations stay whole)."""
        attention = ("self_attention", "cross_attention")
        return TensorParallelPlan(
            colwise=(*(f"{a}.{p}" for a in attention for p in ("to_query", "to_key", "to_value")),
                     "feed_forward.in_layer"),
            rowwise=(*(f"{a}.out_layer" for a in attention), "feed_forward.out_layer"),
            attention=attention, heads_attribute="num_heads", optional=("cross_attention",))

    def cp_plan(self) -> ContextParallelPlan:
        """Split the visual tokens at the first visual block, gather after the last (the output layer needs the whole
        grid); the text blocks run whole on every rank. NABLA is refused: its per-head block mask under Ulysses
        is unchecked (FlexAttention has no CPU backward)."""
        if self.sparse_attention:
            raise Unplanned(f"{self.family} with NABLA sparse attention (attention_type \"nabla\") has no CP plan "
                            "(its FlexAttention block mask under Ulysses is not checked); set parallel.cp = 1")
        last = int(self.load_config("transformer")["num_visual_blocks"]) - 1
        return ContextParallelPlan(
            split_inputs={"visual_transformer_blocks.0": {"visual_embed": 1}},
            gather_output=f"visual_transformer_blocks.{last}", self_attention=("self_attention",),
            sequence_to_heads=("to_query", "to_key", "to_value"), heads_to_sequence="out_layer",
            block_lists=("visual_transformer_blocks",), heads_attribute="num_heads")
