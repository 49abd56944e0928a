"""The Model Spec API: everything both stages need to know about one model family.

A family file (ltx_video.py, wan.py) subclasses `ModelSpec` and fills in what really differs:
component classes, latent normalisation, how the transformer is called, the tiny preset. The rest
lives here once: finding and loading components (each overridable), bucket checks, LoRA, the
validation pipeline, export. Stage 1 loads the components the family declares (`load_stage1`) and
calls `encode_text` / `encode_video` with them; stage 2 calls
`forward`, which returns prediction, target and a loss weight, so first-frame conditioning or other
target changes stay inside the family and the trainer's loss stays generic.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import torch
from torch import Tensor, nn

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import comfy
from vt.shared.models.components import ComponentLoader
from vt.shared.runtime import DTYPES, encoder_dtype

log = logging.getLogger(__name__)

NUM_TRAIN_TIMESTEPS = 1000  # flow-matching schedulers: timestep = sigma * 1000
ALL_EXPERTS = "all"  # model.expert: train every expert of a multi-expert family in one run


@dataclass
class Prediction:
    """What the loss needs: loss = mean(weight * (prediction - target) ** 2)."""

    prediction: Tensor  # model output, same shape as target
    target: Tensor
    weight: Tensor | None  # broadcastable to target; 0 leaves an element out; None = all ones


@dataclass(frozen=True)
class VaeGeometry:
    temporal: int  # frames per latent frame (after the first)
    spatial: int  # pixels per latent pixel
    channels: int  # latent channels
    patch: int  # transformer spatial patch: latent height/width must divide by it


@dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallel splits one transformer block; names are relative to a block.

    Column-wise layers split their output features in rank order (for q/k/v: whole heads per rank),
    row-wise layers split their input features and sum their outputs over the tp group. The
    attention modules then run on their local heads, and RMSNorms over all heads' channels
    (`head_norms`) sum their squares over the tp group so they still match one process.
    """

    colwise: tuple[str, ...]  # e.g. "attn1.to_q", "ff.net.0.proj"
    rowwise: tuple[str, ...]  # e.g. "attn1.to_out.0", "ff.net.2"
    attention: tuple[str, ...]  # attention modules whose `heads` becomes the local head count
    head_norms: tuple[str, ...] = ()  # torch.nn.RMSNorm over all heads' channels (query/key norms)
    # Transformer submodule returning rotary (cos, sin) laid out over all heads' channels on the last
    # dim (LTX-Video); each rank keeps its channels. None when the rotary tables span one head (Wan).
    channel_rope: str | None = None


@dataclass(frozen=True)
class ContextParallelPlan:
    """How context parallel splits the token sequence (Ulysses); names are relative to the transformer.

    The inputs named in `split_inputs` are cut to this rank's chunk along their sequence dim (a
    tensor that has no such dim, or size 1 there, such as a per-sample timestep, stays whole); the
    output of `gather_output` is gathered back along dim 1. Inside each block's self-attention,
    the outputs of `sequence_to_heads` switch from "my tokens, all heads" to "all tokens, my heads"
    and the input of `heads_to_sequence` switches back. Cross-attention keys and values come from
    the text, which is not split: its queries stay on the local tokens with all heads.
    """

    split_inputs: dict[str, dict[str, int]]  # module ("" = the transformer) -> {argument name: sequence dim}
    gather_output: str  # module whose output (B, S/P, C) is gathered to (B, S, C)
    self_attention: tuple[str, ...]  # relative to a block
    sequence_to_heads: tuple[str, ...] = ("norm_q", "norm_k", "to_v")  # relative to an attention module
    heads_to_sequence: str = "to_out.0"
    channel_rope: str | None = None  # as in TensorParallelPlan: rotary tables over all heads' channels


def flow_match_noisy(x0: Tensor, noise: Tensor, sigmas: Tensor) -> Tensor:
    """Rectified-flow interpolation (1 - s) * x0 + s * noise.

    `sigmas` is (B,) (one per sample) or already broadcastable to x0 (e.g. one per latent frame).
    """
    s = sigmas.to(x0.dtype)
    if s.ndim == 1:
        s = s.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise


def flow_inputs(batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x0, noise, sigmas (B,), noisy) in float32 on the latents' device: the batch's latents and their
    rectified-flow interpolation, what a flow-matching family's `forward` starts from."""
    x0 = batch["latents"].float()
    noise = noise.to(x0)
    sigmas = sigmas.to(x0).flatten()
    return x0, noise, sigmas, flow_match_noisy(x0, noise, sigmas)


class ModelSpec(ComponentLoader, ABC):
    family: ClassVar[str]
    # What stage 1 loads, fingerprints (provenance) and hands to encode_text / encode_video, by name
    # (a family whose parts depend on the task, e.g. an image encoder for i2v, makes it a property).
    stage1_components: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "vae")
    default_lora_targets: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    tasks: ClassVar[tuple[str, ...]] = ("t2v",)
    # Attributes of the transformer holding its ModuleLists of repeated blocks, in the order they run: the
    # one list that FSDP, TP, CP, activation checkpointing and compile all walk (`named_blocks`).
    block_lists: ClassVar[tuple[str, ...]]
    # Condition tensor -> the mask the transformer applies to its rows: rows past the mask's last
    # nonzero entry are padding it never reads, which stage 1 need not store (shared/caption_table.py).
    # Unnamed tensors lose only rows that are exactly zero, so their padding is kept bit for bit.
    text_masks: ClassVar[dict[str, str]] = {}
    # Whether the VAE and transformer take one-frame buckets (1xHxW): still images train as those.
    single_frame: ClassVar[bool] = True
    # Whether i2v training can noise the conditioning frame (`model.first_frame_noise`); families that
    # condition on a clean frame refuse the key rather than ignore it.
    noisy_first_frame: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, frame_rate: float):
        """`frame_rate`: the rate frames are sampled at in stage 1 (buckets.fps); families whose
        transformer or pipeline depends on it (LTX-Video's rotary scale) train and sample at it."""
        if config.task not in self.tasks:
            raise ValueError(
                f"model.task = {config.task!r} is not supported for family {self.family!r} yet; "
                f"supported: {list(self.tasks)}. Set model.task to one of them, or pick a family that has it "
                "(docs/families.md)"
            )
        self.config = config
        unknown = sorted(set(config.components) - set(self.component_names()))
        if unknown:
            raise ValueError(f"model.components.{unknown[0]} is not a component of {self.family!r}; allowed: "
                             f"{', '.join(self.component_names())}")
        if not frame_rate > 0:
            raise ValueError(f"buckets.fps must be > 0, got {frame_rate}")
        experts = self.experts()
        if config.expert not in ("", *experts, *((ALL_EXPERTS,) if experts else ())):
            raise ValueError(f"model.expert = {config.expert!r} is not an expert of {self.family!r}; "
                             + (f"choose one of {[*experts, ALL_EXPERTS]}" if experts
                                else "it has one transformer: leave it unset"))
        if config.first_frame_noise > 0 and not (self.noisy_first_frame and config.task == "i2v"):
            raise ValueError(f"model.first_frame_noise = {config.first_frame_noise} does nothing for {self.family!r} "
                             f"task {config.task!r}: " + ("it conditions on a clean first frame" if config.task == "i2v"
                                                          else "it is an i2v setting") + "; remove it")
        self.frame_rate = float(frame_rate)
        self.frozen_dtype = DTYPES[config.dtype]
        # The text length: the config's, else the one the family's pipeline encodes at inference.
        self.max_text_tokens = config.max_text_tokens or self.pipeline_default("max_sequence_length")
        self._lora_metadata: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------- components
    @abstractmethod
    def component_classes(self) -> dict[str, type]:
        """name -> class with `from_pretrained`: text encoder(s), VAE, transformer(s), image encoder ...
        (tokenizers are found by name, see components.py); may depend on `self.config.task`, and a
        family whose classes do not may make it a staticmethod."""

    @abstractmethod
    def pipeline_class(self) -> type:
        """The diffusers pipeline for this config's task (validation, LoRA format)."""

    example_hub_id: ClassVar[str] = ""

    def experts(self) -> dict[str, tuple[str, tuple[float, float]]]:
        """Expert name -> (transformer component, sigma range it denoises), for families that split the
        noise levels between several transformers (Wan 2.2 A14B); empty for one transformer."""
        return {}

    @property
    def expert(self) -> str | None:
        """The expert this run trains (`model.expert`, else the first), None for one transformer or
        when the run trains all of them (`model.expert = "all"`)."""
        if not self.experts() or self.trains_all_experts:
            return None
        return self.config.expert or next(iter(self.experts()))

    @property
    def trains_all_experts(self) -> bool:
        """`model.expert = "all"`: one run trains every expert, each sample by the expert of its sigma."""
        return self.config.expert == ALL_EXPERTS

    @property
    def trained_experts(self) -> dict[str, str]:
        """Expert -> transformer component for a run that trains all experts; {} for one transformer."""
        return {name: component for name, (component, _) in self.experts().items()} if self.trains_all_experts else {}

    @property
    def trained_component(self) -> str:
        """The transformer component this run trains and exports (one expert, or the only transformer)."""
        if self.trains_all_experts:
            raise ValueError("model.expert = \"all\" trains several transformers: see trained_experts")
        return self.experts()[self.expert][0] if self.expert else "transformer"

    def sigma_range(self) -> tuple[float, float]:
        """The noise levels this run trains: all of them, or the trained expert's range."""
        return self.experts()[self.expert][1] if self.expert else (0.0, 1.0)

    def expert_of(self, sigma: float) -> str:
        """The expert that denoises at `sigma`: the one whose [low, high) range holds it (the top range
        also holds 1), as the pipeline hands over at its boundary."""
        for name, (_, (low, high)) in self.experts().items():
            if low <= sigma < high or sigma == high == 1.0:
                return name
        raise ValueError(f"sigma {sigma} is in no expert's range: {self.experts()}")

    def load_stage1(self, device="cpu") -> dict[str, Any]:
        """The stage-1 components this family declares (`stage1_components`), loaded and frozen, in the
        dtype they compute in on `device` (`runtime.encoder_dtype`)."""
        dtype = encoder_dtype(torch.device(device), self.frozen_dtype)
        return {name: self.load_component(name, device, dtype) for name in self.stage1_components}

    # ----------------------------------------------------------------------------- buckets
    @abstractmethod
    def _geometry_from_config(self) -> VaeGeometry:
        """Compression ratios and channels, read from the VAE/transformer configs (no weights)."""

    @cached_property
    def geometry(self) -> VaeGeometry:
        return self._geometry_from_config()

    def _vae_without_weights(self):
        """The VAE class built from its config on the meta device: for ratios the class computes itself."""
        from accelerate import init_empty_weights

        with init_empty_weights():
            return self.component_classes()["vae"].from_config(self.load_config("vae"))

    def check_bucket(self, bucket: Bucket) -> None:
        if bucket.frames == 1 and not self.single_frame:
            raise ValueError(f"bucket {bucket.name}: {self.family} cannot take one-frame buckets (still images); "
                             "remove 1xHxW sizes from buckets.sizes")
        if bucket.frames == 1 and self.config.task == "i2v":
            raise ValueError(f"bucket {bucket.name}: i2v conditions on the first frame, so a one-frame bucket leaves "
                             "nothing to learn; remove 1xHxW sizes from buckets.sizes or use model.task = \"t2v\"")
        g = self.geometry
        pixels = g.spatial * g.patch
        if bucket.frames % g.temporal != 1 % g.temporal:
            raise ValueError(
                f"bucket {bucket.name}: {self.family} frames must be {g.temporal}k+1 (e.g. "
                f"{g.temporal + 1} or {2 * g.temporal + 1}); change buckets.sizes"
            )
        for side, value in (("height", bucket.height), ("width", bucket.width)):
            if value % pixels:
                raise ValueError(
                    f"bucket {bucket.name}: {self.family} {side} must be a multiple of {pixels}; "
                    f"change buckets.sizes (e.g. {max(pixels, value // pixels * pixels)})"
                )

    def tokens_per_sample(self, latent_shape: tuple[int, ...]) -> int:
        """Transformer tokens of one sample with latents (C, F, H, W): the spatial patch folds p x p."""
        _, frames, height, width = latent_shape
        patch = self.geometry.patch
        return frames * (height // patch) * (width // patch)

    def condition_shapes(self, bucket: Bucket) -> dict[str, tuple[int, ...]]:
        """Per-sample shapes of every tensor stage 1 stores for `bucket` (what `encode_text` and
        `encode_video` return), from the components' configs alone: `vt-train plan` runs the transformer on
        fake tensors of these shapes. This default: `prompt_embeds` (text length, text encoder width), the
        masks `text_masks` names, `latents`; families add what else they store (tests compare every family
        with its real encoders)."""
        shapes = {"prompt_embeds": (self.max_text_tokens, self.text_width()), "latents": self.latent_shape(bucket)}
        for embeds, mask in self.text_masks.items():
            if embeds in shapes:
                shapes[mask] = shapes[embeds][:1]
        return shapes

    def text_width(self, name: str = "text_encoder") -> int:
        """The hidden size of a text encoder, from its config."""
        config = self.load_config(name)
        config = getattr(config, "text_config", None) or config
        return getattr(config, "d_model", None) or config.hidden_size

    def latent_shape(self, bucket: Bucket) -> tuple[int, ...]:
        self.check_bucket(bucket)
        g = self.geometry
        return (g.channels, (bucket.frames - 1) // g.temporal + 1, bucket.height // g.spatial, bucket.width // g.spatial)

    # ----------------------------------------------------------------------------- stage 1
    @abstractmethod
    def encode_text(self, encoders: dict[str, Any], captions: list[str]) -> dict[str, Tensor]:
        """Named condition tensors (B, ...) for `captions`, from the loaded stage-1 components."""

    @torch.no_grad()
    def encode_video(self, encoders: dict[str, Any], video: Tensor) -> dict[str, Tensor]:
        """Named latent tensors (B, ...) for `video` (B, 3, F, H, W) in [-1, 1]: latents and any
        per-sample conditioning made from the pixels (an encoded first frame, image embeddings).

        This default is diffusers' most common convention: {"latents": the posterior mode times the
        VAE's `scaling_factor`} (the pipeline divides by it before decoding); families that normalise
        otherwise, or condition on pixels, override it.
        """
        self._check_video(video)
        vae = encoders["vae"]
        return {"latents": (self._vae_mode(vae, video) * vae.config.scaling_factor).float()}

    def _check_video(self, video: Tensor) -> None:
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"video must be (B, 3, F, H, W) in [-1, 1], got shape {tuple(video.shape)}")
        self.check_bucket(Bucket(*video.shape[2:]))

    def _text_pipeline(self, encoders: dict[str, Any]):
        """The family pipeline holding only the given parts (the rest None): its own encode_prompt
        does the encoding, so training conditions match what the pipeline feeds the transformer."""
        return self.pipeline_class()(**{name: encoders.get(name) for name in self.pipeline_parts()})

    def _encode_prompt(self, encoders: dict[str, Any], captions: list[str], **kwargs) -> Any:
        """The family pipeline's own `encode_prompt` over `captions` at this spec's text length, on the
        text encoder's device; `kwargs` go to it as they are."""
        return self._text_pipeline(encoders).encode_prompt(
            list(captions), max_sequence_length=self.max_text_tokens, device=encoders["text_encoder"].device, **kwargs)

    @staticmethod
    def _vae_mode(vae, video: Tensor) -> Tensor:
        """The VAE posterior's mode for `video` (stage 1 is deterministic), in the VAE's dtype."""
        return vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode()

    def pipeline_options(self) -> dict[str, Any]:
        """Pipeline constructor arguments that are settings, not components (e.g. an expert boundary)."""
        return {}

    def pipeline_parts(self) -> list[str]:
        """The pipeline's constructor arguments that are components of this family."""
        names = set(self.component_names())
        return [name for name in inspect.signature(self.pipeline_class().__init__).parameters if name in names]

    # ----------------------------------------------------------------------------- stage 2
    @abstractmethod
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generator: torch.Generator | None = None) -> Prediction: ...

    def named_blocks(self, transformer) -> list[tuple[str, nn.Module]]:
        """("transformer_blocks.3", block) for every block of every list in `block_lists`, in running order."""
        named = []
        for attr in self.block_lists:
            blocks = getattr(transformer, attr, None)
            if not isinstance(blocks, nn.ModuleList):
                raise TypeError(f"{type(transformer).__name__}.{attr} is not a ModuleList of blocks; fix block_lists "
                                f"of the {self.family} spec")
            named += [(f"{attr}.{index}", block) for index, block in enumerate(blocks)]
        return named

    def blocks(self, transformer) -> list[nn.Module]:
        """Every block of the transformer (`named_blocks` without the names)."""
        return [block for _, block in self.named_blocks(transformer)]

    def add_lora(self, transformer, rank: int, alpha: float, targets: list[str] | None) -> None:
        """Freeze the transformer and inject peft LoRA layers (only they train)."""
        from peft import LoraConfig

        if rank < 1:
            raise ValueError(f"train.lora_rank must be >= 1, got {rank}")
        targets = list(targets or self.default_lora_targets)
        transformer.requires_grad_(False)
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=True))
        found = [n for n, _ in transformer.named_parameters() if "lora_" in n]
        if not found:
            raise ValueError(f"train.lora_targets {targets} matched no layer of the {self.family} transformer")
        self._lora_metadata = {"r": rank, "lora_alpha": alpha, "target_modules": targets}

    def full_trainable(self, transformer) -> None:
        """Mark what a full fine-tune trains: every parameter, unless the family leaves some out (LTX-2's
        audio stream, which video-only training gives no gradient)."""
        transformer.requires_grad_(True)

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> TensorParallelPlan:
        """Which layers tensor parallel splits (used by vt.train.parallel.tp.apply_tp)."""
        raise NotImplementedError(f"family {self.family!r} has no TP plan; set parallel.tp = 1 "
                                  f"(or add tp_plan() to its spec file)")

    def cp_plan(self) -> ContextParallelPlan:
        """Where context parallel splits and gathers the sequence (used by vt.train.parallel.cp.apply_cp)."""
        raise NotImplementedError(f"family {self.family!r} has no CP plan; set parallel.cp = 1 "
                                  f"(or add cp_plan() to its spec file)")

    # ----------------------------------------------------------------------------- validation
    # encode_text's condition names -> the pipeline call's (`prompt_embeds=`, ...), where they differ; the
    # negative prompt's are the same names with "negative_" in front.
    pipeline_text_names: ClassVar[dict[str, str]] = {}
    negative_prompt: ClassVar[str] = ""  # what the pipelines encode for negative_prompt=None

    def text_parts(self) -> list[str]:
        """The pipeline parts that turn prompts (and i2v images) into conditions: tokenizers, text and image
        encoders. Stage 1 runs them and stores their output in the window, so validation never loads them."""
        prefixes = ("tokenizer", "text_encoder", "image_encoder", "image_processor")
        return [name for name in self.pipeline_parts() if name.startswith(prefixes)]

    @torch.no_grad()
    def encode_validation_text(self, encoders: dict[str, Any], prompt: str) -> dict[str, Tensor]:
        """One prompt's conditions (batch of one) as the pipeline's call takes them (`prompt_embeds` ...):
        `encode_text`'s, renamed by `pipeline_text_names`."""
        return {self.pipeline_text_names.get(k, k): v for k, v in self.encode_text(encoders, [prompt]).items()}

    @property
    def image_conditions(self) -> bool:
        """Whether this run's i2v pipeline makes conditions of its image with a stage-1 encoder
        (`encode_validation_image`), so stage 1 encodes the validation images too."""
        return False

    def encode_validation_image(self, encoders: dict[str, Any], image: np.ndarray) -> dict[str, Tensor]:
        """The conditions an i2v pipeline makes of its image with a stage-1 encoder (Wan 2.1's CLIP
        `image_embeds`), as its call takes them; {} where the VAE alone conditions on the image."""
        return {}

    def build_pipeline(self, transformer, device="cpu", text_encoders: bool = True, dtype: torch.dtype | None = None,
                       **loaded):
        """The family pipeline around `transformer`; pass already loaded parts (e.g. vae=...) to reuse them.
        The parts it loads are in `dtype` (default `model.dtype`).

        `transformer` is the trained one, or for a run over all experts a mapping expert -> transformer
        (an nn.ModuleDict); experts not trained load frozen. `text_encoders=False` leaves the `text_parts`
        out (None): the pipeline then needs its conditions passed in (`generate(..., conditions=...)`)."""
        if isinstance(transformer, (dict, nn.ModuleDict)):
            trained = {self.experts()[name][0]: module for name, module in transformer.items()}
        else:
            trained = {self.trained_component: transformer}
        left_out = set() if text_encoders else set(self.text_parts())
        parts = {name: None if name in left_out else loaded.get(name) or self.load_component(name, device, dtype)
                 for name in self.pipeline_parts() if name not in trained}
        parts.update(trained)
        pipeline = self.pipeline_class()(**parts, **self.pipeline_options())
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def generate(self, pipeline, prompt: str | None, bucket: Bucket, steps: int, seed: int, image=None,
                 conditions: dict[str, Tensor] | None = None, decode: bool = True, **pipeline_kwargs) -> np.ndarray | None:
        """(F, H, W, 3) uint8 frames of one sample from `pipeline` (extra kwargs go to the pipeline).
        `conditions`: the prompt's (and negative prompt's) encoded conditions in the pipeline's names, in
        place of the prompt (a pipeline built without text encoders). `decode=False` stops at the latents
        (never decoded) and returns None: a validation stand-in that only keeps sharded forwards in step."""
        kwargs = {**self.pipeline_inputs(prompt, bucket, steps, seed, image), **pipeline_kwargs,
                  "output_type": "np" if decode else "latent"}
        if conditions is not None:
            kwargs.update(prompt=None, **self.pipeline_conditions(pipeline, conditions))
        frames = pipeline(**kwargs).frames[0]
        if not decode:
            return None
        return (np.clip(np.asarray(frames, dtype=np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)

    def pipeline_conditions(self, pipeline, conditions: dict[str, Tensor]) -> dict[str, Tensor]:
        """The stored conditions as call arguments of `pipeline` (a family whose pipeline takes one of them
        another way arranges that here)."""
        return conditions

    def pipeline_inputs(self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None) -> dict[str, Any]:
        """The pipeline call arguments `generate` uses: the same text length and frame rate as training."""
        self.check_bucket(bucket)
        kwargs = dict(prompt=prompt, height=bucket.height, width=bucket.width, num_frames=bucket.frames,
                      num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
                      **self.inference_settings())
        kwargs.update(self._generate_kwargs(image))
        return kwargs

    def inference_settings(self) -> dict[str, Any]:
        """Pipeline call arguments that must match how the model was trained (text length; the frame
        rate where the family's transformer depends on it). Validation passes them; a user sampling
        with the pipeline's defaults gets other conditioning where they differ (`inference_mismatches`)."""
        return {"max_sequence_length": self.max_text_tokens}

    def pipeline_default(self, argument: str) -> Any:
        """The default of one of the family pipeline's call arguments (None if it has no such argument)."""
        parameter = inspect.signature(self.pipeline_class().__call__).parameters.get(argument)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default

    def inference_mismatches(self) -> list[str]:
        """One line per training setting that differs from the pipeline's default at inference."""
        pipeline = self.pipeline_class().__name__
        lines = []
        for argument, value in self.inference_settings().items():
            default = self.pipeline_default(argument)
            if default is not None and default != value:
                lines.append(f"{self.family} trains with {argument}={value:g} but {pipeline} uses {default:g} by "
                             f"default: pass {argument}={value:g} when sampling with the trained weights")
        return lines

    def _generate_kwargs(self, image) -> dict[str, Any]:
        if image is not None:
            raise ValueError(f"{self.family} with task {self.config.task!r} takes no image; use model.task = \"i2v\"")
        return {}

    # ----------------------------------------------------------------------------- export
    def save_lora(self, lora_state_dict: dict[str, Tensor], out_dir, lora_config: dict | None = None,
                  expert: str | None = None) -> Path:
        """out_dir/pytorch_lora_weights.safetensors, readable by the pipeline's load_lora_weights, and
        out_dir/lora_comfyui.safetensors under the original module names (comfy.py); returns the first.

        The rank/alpha/targets go into the file's metadata so the loader rebuilds the same scaling;
        they come from this spec's `add_lora` unless `lora_config` ({r, lora_alpha, target_modules}) is given.
        `expert`: the LoRA of that expert in a run over all experts, written as
        pytorch_lora_weights_<expert>.safetensors and lora_comfyui_<expert>.safetensors.
        """
        metadata = lora_config or self._lora_metadata
        if metadata is None:
            raise ValueError("save_lora needs the LoRA rank and alpha: call add_lora on this spec first "
                             "or pass lora_config={'r': ..., 'lora_alpha': ..., 'target_modules': [...]}")
        if not lora_state_dict or not all(".lora_" in k for k in lora_state_dict):
            raise ValueError("lora_state_dict must be peft's get_peft_model_state_dict(transformer): "
                             "keys like 'blocks.0.attn1.to_q.lora_A.weight'")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in lora_state_dict.items()}
        weight_name = lora_weight_name(expert)
        if hasattr(self.pipeline_class(), "save_lora_weights"):
            self.pipeline_class().save_lora_weights(out, transformer_lora_layers=tensors, safe_serialization=True,
                                                    weight_name=weight_name,
                                                    transformer_lora_adapter_metadata=dict(metadata))
        else:  # a pipeline without a LoRA mixin (HunyuanVideo 1.5): diffusers' own writer, the same file format
            from diffusers.loaders.lora_base import LoraBaseMixin

            LoraBaseMixin._save_lora_weights(out, {"transformer": tensors}, {"transformer": dict(metadata)},
                                             weight_name=weight_name)
        self.save_comfy_lora(tensors, out / comfy.filename(expert or self.expert), metadata)
        return out / weight_name

    def lora_load_kwargs(self, expert: str | None = None) -> dict[str, Any]:
        """What `pipeline.load_lora_weights` needs besides the file to load this run's LoRA (or that of
        `expert`): which transformer it goes into."""
        return {}

    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """Load a LoRA file `save_lora` wrote (the diffusers or the ComfyUI one, by `weight_name`) into
        `pipeline`: its own `load_lora_weights` with `lora_load_kwargs`; a family whose pipeline has no
        LoRA loader gives its own."""
        kwargs = {"weight_name": weight_name} if weight_name else {}
        pipeline.load_lora_weights(folder, **kwargs, **self.lora_load_kwargs(expert))

    # (diffusers module regex, original module name) pairs, first full match wins; see comfy.py.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ()
    comfy_alpha: ClassVar[bool] = True  # whether the family's loaders read `.alpha` (else baked into lora_B)

    def save_comfy_lora(self, tensors: dict[str, Tensor], path: Path, metadata: dict) -> Path | None:
        """The ComfyUI form of a LoRA; None (with a warning) when the family has no key table or a
        module has no original name."""
        from safetensors.torch import save_file

        try:
            if not self.original_names:
                raise ValueError(f"family {self.family!r} has no original key table")
            state = comfy.comfy_state_dict(tensors, self.original_names, int(metadata["r"]),
                                           float(metadata["lora_alpha"]), write_alpha=self.comfy_alpha)
        except ValueError as err:
            log.warning("LoRA saved for diffusers only: %s", err)
            return None
        save_file(state, str(path), metadata={"format": "pt", "vt_family": self.family})
        return path

    def save_full(self, transformer, out_dir) -> Path:
        """save_pretrained into out_dir; usable as model.components.transformer."""
        out = Path(out_dir)
        transformer.save_pretrained(out, safe_serialization=True)
        return out

    @classmethod
    @abstractmethod
    def make_tiny(cls, out_dir, seed: int = 0) -> Path: ...


def lora_weight_name(expert: str | None = None) -> str:
    """The diffusers LoRA file: pytorch_lora_weights.safetensors, with `_<expert>` for one of several
    experts trained in one run."""
    return f"pytorch_lora_weights_{expert}.safetensors" if expert else "pytorch_lora_weights.safetensors"


def to_pil_image(image):
    """A PIL image or an (H, W, 3) uint8 array as an RGB PIL image (what image-to-video pipelines take)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"image must be a PIL image or an (H, W, 3) uint8 array, got {array.dtype} {array.shape}")
    return Image.fromarray(array)


_INPUT_DTYPES: "weakref.WeakKeyDictionary[nn.Module, torch.dtype]" = weakref.WeakKeyDictionary()


def input_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype to feed the transformer (diffusers' `.dtype`), looked up once per model: `.dtype`
    walks every submodule, which costs milliseconds per step on a large model."""
    dtype = _INPUT_DTYPES.get(transformer)
    if dtype is None:
        dtype = _INPUT_DTYPES[transformer] = transformer.dtype
    return dtype
