"""The Model Spec API: everything both stages need to know about one model family.

A family file (ltx_video.py, wan.py) subclasses `ModelSpec` and fills in what really differs:
component classes, latent normalisation, how the transformer is called, the tiny preset. The rest
lives here once: finding and loading components (each overridable), bucket checks, LoRA, the
validation pipeline, export. Stage 1 calls `encode_conditions` / `encode_latents`; stage 2 calls
`forward`, which returns prediction, target and a loss weight, so first-frame conditioning or other
target changes stay inside the family and the trainer's loss stays generic.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
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
from vt.shared.runtime import DTYPES

log = logging.getLogger(__name__)

COMPONENTS = ("tokenizer", "text_encoder", "vae", "transformer", "scheduler")
NUM_TRAIN_TIMESTEPS = 1000  # flow-matching schedulers of both families: timestep = sigma * 1000
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelLoadError(OSError):
    """A component (or its config) could not be loaded; the message names it, where from, and the fix."""


def hub_offline() -> bool:
    """Whether the Hugging Face hub may not be contacted (HF_HUB_OFFLINE, as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


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


class ModelSpec(ABC):
    family: ClassVar[str]
    default_lora_targets: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    tasks: ClassVar[tuple[str, ...]] = ("t2v",)
    blocks_attr: ClassVar[str]  # attribute of the transformer holding its ModuleList of blocks

    def __init__(self, config: ModelConfig, frame_rate: float):
        """`frame_rate`: the rate frames are sampled at in stage 1 (buckets.fps); families whose
        transformer or pipeline depends on it (LTX-Video's rotary scale) train and sample at it."""
        if config.task not in self.tasks:
            raise ValueError(
                f"model.task = {config.task!r} is not supported for family {self.family!r} yet; "
                f"supported: {list(self.tasks)}. Set model.task = \"t2v\" or use family \"ltx-video\" for i2v."
            )
        unknown = sorted(set(config.components) - set(COMPONENTS))
        if unknown:
            raise ValueError(f"model.components.{unknown[0]} is not a component; allowed: {', '.join(COMPONENTS)}")
        if not frame_rate > 0:
            raise ValueError(f"buckets.fps must be > 0, got {frame_rate}")
        self.config = config
        self.frame_rate = float(frame_rate)
        self.frozen_dtype = DTYPES[config.dtype]
        # The text length: the config's, else the one the family's pipeline encodes at inference.
        self.max_text_tokens = config.max_text_tokens or self.pipeline_default("max_sequence_length")
        self._lora_metadata: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------- components
    @staticmethod
    @abstractmethod
    def component_classes() -> dict[str, type]:
        """name -> class with `from_pretrained` for text_encoder, vae, transformer."""

    @abstractmethod
    def pipeline_class(self) -> type:
        """The diffusers pipeline for this config's task (validation, LoRA format)."""

    def source(self, name: str) -> tuple[str, str | None]:
        """(path or hub id, subfolder) of a component; errors name the config key to set."""
        override = self.config.components.get(name)
        if override:
            if not Path(override).exists() and not _HUB_ID.match(override):
                raise FileNotFoundError(
                    f"model.components.{name} = {override!r} is neither a folder nor a hub id (org/name). "
                    f"Point it at a folder holding only the {name}, e.g. a transformer saved by save_full."
                )
            return override, None
        root = self.config.path
        if Path(root).exists():
            if not (Path(root) / name).is_dir():
                raise FileNotFoundError(
                    f"model.path = {root!r} has no {name!r} folder. Use a diffusers-layout folder "
                    f"(model_index.json + subfolders) or set model.components.{name} = <folder or hub id>."
                )
            return root, name
        if _HUB_ID.match(root):
            return root, name
        raise FileNotFoundError(
            f"model.path = {root!r} does not exist. Build a tiny preset with "
            f"`python scripts/make_tiny_model.py --family {self.family} {root}`, or set model.path to a "
            f"diffusers-layout folder or hub id (e.g. {self.example_hub_id})."
        )

    example_hub_id: ClassVar[str] = ""

    def _from_pretrained(self, cls: Any, name: str, **kwargs) -> Any:
        path, subfolder = self.source(name)
        if subfolder is not None:
            kwargs["subfolder"] = subfolder
        try:
            return cls.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as err:
            raise self.load_error(name, path, err) from err

    def load_error(self, name: str, path: str, err: Exception) -> "ModelLoadError":
        """One line saying which component failed to load from where, and what to do about it."""
        key = f"model.components.{name}" if name in self.config.components else "model.path"
        if not Path(path).exists() and hub_offline():
            return ModelLoadError(
                f"cannot load the {name} of {self.family!r} from hub id {path!r}: the Hugging Face hub is offline "
                f"(HF_HUB_OFFLINE=1) and {path!r} is not in the local cache. Download it where there is network "
                f"(`hf download {path} --local-dir DIR`) and set {key} = \"DIR\", or unset HF_HUB_OFFLINE")
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ModelLoadError(f"cannot load the {name} of {self.family!r} from {path!r}: {reason}. Check {key}; "
                              "a hub id needs network access or a filled local cache")

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return self._from_pretrained(AutoTokenizer, "tokenizer")

    def load_text_encoder(self, device="cpu"):
        return _frozen(self._from_pretrained(self.component_classes()["text_encoder"], "text_encoder",
                                             dtype=self.frozen_dtype), device)

    def load_vae(self, device="cpu"):
        return _frozen(self._from_pretrained(self.component_classes()["vae"], "vae",
                                             torch_dtype=self.frozen_dtype), device)

    def load_transformer(self, device="cpu", dtype=None):
        """The trainable model, float32 unless `dtype` is given."""
        model = self._from_pretrained(self.component_classes()["transformer"], "transformer",
                                      torch_dtype=dtype or torch.float32)
        return model.to(device)

    def load_scheduler(self):
        """The scheduler class named in its own config (a real checkpoint may use another one)."""
        import diffusers

        config = self._load_config("scheduler")
        cls = getattr(diffusers, config.get("_class_name", ""), None)
        if cls is None:
            raise ValueError(f"scheduler config of {self.source('scheduler')[0]!r} names unknown class "
                             f"{config.get('_class_name')!r}; set model.components.scheduler to a diffusers scheduler")
        return cls.from_config(config)

    # ----------------------------------------------------------------------------- buckets
    @abstractmethod
    def _geometry_from_config(self) -> VaeGeometry:
        """Compression ratios and channels, read from the VAE/transformer configs (no weights)."""

    @cached_property
    def geometry(self) -> VaeGeometry:
        return self._geometry_from_config()

    def _load_config(self, name: str) -> dict:
        """A component's config (config.json / scheduler_config.json) as a dict, without weights."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        reader = FlowMatchEulerDiscreteScheduler if name == "scheduler" else self.component_classes()[name]
        path, subfolder = self.source(name)
        kwargs = {"subfolder": subfolder} if subfolder else {}
        try:
            return dict(reader.load_config(path, **kwargs))
        except (OSError, ValueError) as err:
            raise self.load_error(name, path, err) from err

    def check_bucket(self, bucket: Bucket) -> None:
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

    def latent_shape(self, bucket: Bucket) -> tuple[int, ...]:
        self.check_bucket(bucket)
        g = self.geometry
        return (g.channels, (bucket.frames - 1) // g.temporal + 1, bucket.height // g.spatial, bucket.width // g.spatial)

    # ----------------------------------------------------------------------------- stage 1
    @abstractmethod
    def encode_conditions(self, tokenizer, text_encoder, captions: list[str]) -> dict[str, Tensor]: ...

    @abstractmethod
    def encode_latents(self, vae, video: Tensor) -> dict[str, Tensor]: ...

    def _check_video(self, video: Tensor) -> None:
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"video must be (B, 3, F, H, W) in [-1, 1], got shape {tuple(video.shape)}")
        self.check_bucket(Bucket(*video.shape[2:]))

    def _text_pipeline(self, tokenizer, text_encoder):
        """The family pipeline holding only the text parts: its own encode_prompt does the encoding,
        so training conditions match what the pipeline feeds the transformer at inference."""
        cls = self.pipeline_class()
        return cls(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, transformer=None, scheduler=None)

    # ----------------------------------------------------------------------------- stage 2
    @abstractmethod
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generator: torch.Generator | None = None) -> Prediction: ...

    def blocks(self, transformer) -> list[nn.Module]:
        return list(getattr(transformer, self.blocks_attr))

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
    def build_pipeline(self, transformer, device="cpu", **loaded):
        """The family pipeline around `transformer`; pass already loaded parts (e.g. vae=...) to reuse them."""
        parts = {
            "tokenizer": loaded.get("tokenizer") or self.load_tokenizer(),
            "text_encoder": loaded.get("text_encoder") or self.load_text_encoder(device),
            "vae": loaded.get("vae") or self.load_vae(device),
            "scheduler": loaded.get("scheduler") or self.load_scheduler(),
        }
        pipeline = self.pipeline_class()(transformer=transformer, **parts)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def generate(self, pipeline, prompt: str, bucket: Bucket, steps: int, seed: int, image=None,
                 **pipeline_kwargs) -> np.ndarray:
        """(F, H, W, 3) uint8 frames of one sample from `pipeline` (extra kwargs go to the pipeline)."""
        kwargs = {**self.pipeline_inputs(prompt, bucket, steps, seed, image), **pipeline_kwargs, "output_type": "np"}
        frames = pipeline(**kwargs).frames[0]
        return (np.clip(np.asarray(frames, dtype=np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)

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
    def save_lora(self, lora_state_dict: dict[str, Tensor], out_dir, lora_config: dict | None = None) -> Path:
        """out_dir/pytorch_lora_weights.safetensors, readable by the pipeline's load_lora_weights.

        The rank/alpha/targets go into the file's metadata so the loader rebuilds the same scaling;
        they come from this spec's `add_lora` unless `lora_config` ({r, lora_alpha, target_modules}) is given.
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
        self.pipeline_class().save_lora_weights(out, transformer_lora_layers=tensors, safe_serialization=True,
                                                transformer_lora_adapter_metadata=dict(metadata))
        return out / "pytorch_lora_weights.safetensors"

    def save_full(self, transformer, out_dir) -> Path:
        """save_pretrained into out_dir; usable as model.components.transformer."""
        out = Path(out_dir)
        transformer.save_pretrained(out, safe_serialization=True)
        return out

    @classmethod
    @abstractmethod
    def make_tiny(cls, out_dir, seed: int = 0) -> Path: ...


_INPUT_DTYPES: "weakref.WeakKeyDictionary[nn.Module, torch.dtype]" = weakref.WeakKeyDictionary()


def input_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype to feed the transformer (diffusers' `.dtype`), looked up once per model: `.dtype`
    walks every submodule, which costs milliseconds per step on a large model."""
    dtype = _INPUT_DTYPES.get(transformer)
    if dtype is None:
        dtype = _INPUT_DTYPES[transformer] = transformer.dtype
    return dtype


def _frozen(model: nn.Module, device) -> nn.Module:
    model.requires_grad_(False)
    return model.eval().to(device)
