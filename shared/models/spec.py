"""The Model Spec API: everything both stages need to know about one model family.

A family module subclasses `ModelSpec` and declares what it is (components and pipelines by import string, block
lists, LoRA key tables, optional roles); it overrides only what is its own: `encode_text` / `encode_video` (stage
1), `forward` (stage 2: prediction, target and loss weight, so the trainer's loss stays generic) and its plans.
docs/model_spec.md has the contract; docs/families.md what a new family touches.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.errors import UserError
from vt.shared.models.components import ComponentLoader, load_class
from vt.shared.models.experts import ExpertsMixin
from vt.shared.models.flow import FlowRecipe, Prediction
from vt.shared.models.frame_conditions import FrameConditions, task_of
from vt.shared.models.lora import LoraMixin
from vt.shared.models.pipeline import PipelineMixin
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.roles import ControlVideo, PerFrameNoise, SoundStream
from vt.shared.models.tiny import save_tiny, seeded
from vt.shared.runtime import DTYPES, encoder_dtype


@dataclass(frozen=True)
class VaeGeometry:
    temporal: int  # frames per latent frame (after the first)
    spatial: int  # pixels per latent pixel
    channels: int  # latent channels
    patch: int  # transformer spatial patch: latent height/width must divide by it


class ModelSpec(ComponentLoader, ExpertsMixin, LoraMixin, PipelineMixin, ABC):
    family: ClassVar[str]
    example_hub_id: ClassVar[str] = ""
    tasks: ClassVar[tuple[str, ...]] = ("t2v",)
    # Component name -> "module:Class" with `from_pretrained` (tokenizers are found by name), and a task's additions.
    components: ClassVar[dict[str, str]]
    task_components: ClassVar[dict[str, dict[str, str]]] = {}
    pipelines: ClassVar[dict[str, str]]  # task -> "module:Class" of the family's diffusers pipeline
    # What stage 1 loads, fingerprints and hands to encode_text / encode_video (with a task's: `stage1_components`).
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "vae")
    # The transformer's ModuleLists of repeated blocks, in running order: what every layout walks (`named_blocks`).
    block_lists: ClassVar[tuple[str, ...]]
    # Why pipeline stages (parallel.pp > 1) cannot split these blocks (blocks that take other blocks' outputs as side
    # inputs), refused at start-up with this reason; "" where they can (vt.train.parallel.pp).
    pipeline_refusal: ClassVar[str] = ""
    # Condition tensor -> the mask the transformer applies to its rows: rows past its last nonzero entry are padding
    # stage 1 need not store (shared/caption_table.py); unnamed tensors lose only rows that are exactly zero.
    text_masks: ClassVar[dict[str, str]] = {}
    # Whether the VAE and transformer take one-frame buckets (1xHxW): still images train as those.
    single_frame: ClassVar[bool] = True
    # Whether i2v training can noise the conditioning frame (`model.first_frame_noise`; the others refuse the key).
    noisy_first_frame: ClassVar[bool] = False
    # Optional members (roles.py), None where the family lacks the capability (its config keys then refused):
    # a noise level per latent frame (`model.diffusion_forcing`), a control video per sample, a sound stream (built
    # with the spec as `self.sound`; `model.audio`).
    per_frame_noise: ClassVar[PerFrameNoise | None] = None
    control_video: ClassVar[ControlVideo | None] = None
    sound_stream: ClassVar[type[SoundStream] | None] = None
    # The [flow] defaults (sigma sampling, shift, loss weighting) from the family's reference training recipe
    # (docs/families.md cites each); vt's own where no reference publishes one.
    flow_recipe: ClassVar[FlowRecipe] = FlowRecipe()

    def __init__(self, config: ModelConfig, frame_rate: float):
        """`frame_rate`: the rate frames are sampled at in stage 1 (buckets.fps); families whose
        transformer or pipeline depends on it (LTX-Video's rotary scale) train and sample at it."""
        if task_of(config) not in self.tasks:
            raise UserError(
                f"model.task = {task_of(config)!r} is not supported for family {self.family!r} yet; "
                f"supported: {list(self.tasks)}. Set model.task to one of them, or pick a family that has it "
                "(docs/families.md)"
            )
        self.config = config
        # The clip's frames the task conditions on (i2v: the first, flf2v: first and last); None for t2v.
        self.frame_conditions = FrameConditions.of(config)
        unknown = sorted(set(config.components) - set(self.component_names()))
        if unknown:
            raise UserError(
                f"model.components.{unknown[0]} is not a component of {self.family!r}; allowed: "
                f"{', '.join(self.component_names())}"
            )
        if not frame_rate > 0:
            raise UserError(f"buckets.fps must be > 0, got {frame_rate}")
        self.check_expert()
        first_only = self.frame_conditions and not self.frame_conditions.last
        if config.first_frame_noise > 0 and not (self.noisy_first_frame and first_only):
            raise UserError(
                f"model.first_frame_noise = {config.first_frame_noise} does nothing for {self.family!r} "
                f"task {task_of(config)!r}: "
                + ("it conditions on a clean first frame" if first_only else "it is an i2v setting")
                + "; remove it"
            )
        if config.diffusion_forcing and not self.per_frame_noise:
            raise UserError(
                f"model.diffusion_forcing = true needs a transformer that takes a noise level per latent "
                f"frame; the {self.family!r} transformer takes one timestep per sample. Remove it, or "
                "pick a family with diffusion forcing (docs/families.md)"
            )
        self.frame_rate = float(frame_rate)
        self.sound = self.sound_stream(self) if self.sound_stream else None
        if config.audio and not self.sound:
            raise UserError(
                f"model.audio = true needs a family with a sound stream; {self.family!r} generates video "
                "only. Remove it, or pick a family that trains audio (docs/families.md)"
            )
        modes = self.sound.timestep_modes if self.sound else ("shared",)
        if config.audio_timesteps not in (None, *modes):
            raise UserError(
                f"model.audio_timesteps = {config.audio_timesteps!r}: the {self.family!r} transformer takes "
                f"{' or '.join(repr(m) for m in modes)} audio timesteps; remove it"
            )
        self.audio_timesteps = config.audio_timesteps or modes[0]
        self.frozen_dtype = DTYPES[config.dtype]
        # The text length: the config's, else the one the family's pipeline encodes at inference.
        self.max_text_tokens = config.max_text_tokens or self.pipeline_default("max_sequence_length")
        self._lora_metadata = None

    # ----------------------------------------------------------------------------- components
    def component_classes(self) -> dict[str, type]:
        """name -> class of every component this config's task has (`components` and `task_components`)."""
        declared = {**self.components, **self.task_components.get(task_of(self.config), {})}
        return {name: load_class(path) for name, path in declared.items()}

    def pipeline_class(self) -> type:
        """The diffusers pipeline for this config's task (validation, LoRA format)."""
        return load_class(self.pipelines[task_of(self.config)])

    @property
    def stage1_components(self) -> tuple[str, ...]:
        """`stage1_base`, then the image encoders and processors this task adds (`task_components`)."""
        added = [
            name
            for name in self.task_components.get(task_of(self.config), {})
            if name not in self.stage1_base and not name.startswith("transformer")
        ]
        if self.config.audio:
            added += [name for name in self.sound.components if name not in self.stage1_base]
        return (*self.stage1_base, *added)

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

    @property
    def vae_tiles(self) -> bool:
        """Whether the family's VAE can encode and decode in tiles (`enable_tiling`), from its class alone."""
        return hasattr(self.class_of("vae"), "enable_tiling")

    def _vae_without_weights(self):
        """The VAE class built from its config on the meta device: for ratios the class computes itself."""
        from accelerate import init_empty_weights

        with init_empty_weights():
            return self.component_classes()["vae"].from_config(self.load_config("vae"))

    def check_bucket(self, bucket: Bucket) -> None:
        if bucket.frames == 1 and not self.single_frame:
            raise UserError(
                f"bucket {bucket.name}: {self.family} cannot take one-frame buckets (still images); "
                "remove 1xHxW sizes from buckets.sizes"
            )
        if bucket.frames == 1 and self.frame_conditions:
            raise UserError(
                f"bucket {bucket.name}: {self.frame_conditions.name} conditions on the "
                f"{self.frame_conditions.described}, so a one-frame "
                "bucket leaves nothing to learn; remove 1xHxW sizes from buckets.sizes or use "
                'model.task = "t2v"'
            )
        g = self.geometry
        pixels = g.spatial * g.patch
        if bucket.frames % g.temporal != 1 % g.temporal:
            raise UserError(
                f"bucket {bucket.name}: {self.family} frames must be {g.temporal}k+1 (e.g. "
                f"{g.temporal + 1} or {2 * g.temporal + 1}); change buckets.sizes"
            )
        for side, value in (("height", bucket.height), ("width", bucket.width)):
            if value % pixels:
                raise UserError(
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
        if self.config.audio:
            shapes["audio_latents"] = self.sound.latent_shape(bucket)
        return shapes

    def text_width(self, name: str = "text_encoder") -> int:
        """The hidden size of a text encoder, from its config."""
        config = self.load_config(name)
        config = getattr(config, "text_config", None) or config
        return getattr(config, "d_model", None) or config.hidden_size

    def latent_shape(self, bucket: Bucket) -> tuple[int, ...]:
        self.check_bucket(bucket)
        g = self.geometry
        return (
            g.channels,
            (bucket.frames - 1) // g.temporal + 1,
            bucket.height // g.spatial,
            bucket.width // g.spatial,
        )

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
        otherwise, or condition on pixels, override it. A family with `control_video` takes it as
        `encode_video(encoders, video, control=...)`: the control clip (B, 3, F, H, W) in [-1, 1], aligned
        with `video` frame for frame and pixel for pixel; stage 1 passes `control` to no other family.
        """
        self._check_video(video)
        vae = encoders["vae"]
        return {"latents": (self.vae_mode(vae, video) * vae.config.scaling_factor).float()}

    def _check_video(self, video: Tensor) -> None:
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"video must be (B, 3, F, H, W) in [-1, 1], got shape {tuple(video.shape)}")
        self.check_bucket(Bucket(*video.shape[2:]))

    @staticmethod
    def vae_mode(vae, video: Tensor) -> Tensor:
        """The VAE posterior's mode for `video` (stage 1 is deterministic), in the VAE's dtype."""
        return vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode()

    # ----------------------------------------------------------------------------- stage 2
    def noise_levels(self, latent_shape: tuple[int, ...]) -> int:
        """How many independent sigmas the trainer draws per sample of latents (C, F, H, W): 1, or under
        `model.diffusion_forcing` the family's `per_frame_noise.levels`."""
        return self.per_frame_noise.levels(latent_shape) if self.config.diffusion_forcing else 1

    @abstractmethod
    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """Prediction, target and loss weight of a batch at `sigmas` with `noise`. `generators`: one per row, keyed
        by the sample (not the rank: train/parallel/batching.py `spec_generators`), for the family's own draws
        (LTX-Video's first-frame noise), so every layout draws what one process draws."""

    def named_blocks(self, transformer) -> list[tuple[str, nn.Module]]:
        """("transformer_blocks.3", block) for every block of every list in `block_lists`, in running order;
        under pipeline parallel only this stage's blocks (the others' are parameterless relays, which every
        layout skips: train/parallel/pp.py)."""
        named = []
        for attr in self.block_lists:
            blocks = getattr(transformer, attr, None)
            if not isinstance(blocks, nn.ModuleList):
                raise TypeError(
                    f"{type(transformer).__name__}.{attr} is not a ModuleList of blocks; fix block_lists "
                    f"of the {self.family} spec"
                )
            named += [
                (f"{attr}.{index}", block)
                for index, block in enumerate(blocks)
                if not getattr(block, "pipeline_relay", False)
            ]
        return named

    def blocks(self, transformer) -> list[nn.Module]:
        """Every block of the transformer (`named_blocks` without the names)."""
        return [block for _, block in self.named_blocks(transformer)]

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> TensorParallelPlan | None:
        """Which layers tensor parallel splits (vt.train.parallel.tp.apply_tp); None: the family has no plan."""
        return None

    def cp_plan(self) -> ContextParallelPlan | None:
        """Where context parallel splits and gathers the sequence (vt.train.parallel.cp.apply_cp); None: no plan."""
        return None

    # ----------------------------------------------------------------------------- tiny preset
    @classmethod
    def make_tiny(cls, out_dir, seed: int = 0, task: str = "t2v", parts=None) -> Path:
        """The tiny preset of `task` in diffusers layout, identical for a seed, from the family's preset module
        (`presets/<module>.py`: `parts(task)` or the given `parts`, optionally `pipeline(task)` and `INDEX_NAMES`)."""
        if task not in cls.tasks:
            raise ValueError(f"no tiny {cls.family} preset for task {task!r}; tasks: {list(cls.tasks)}")
        preset = importlib.import_module(f"vt.shared.models.presets.{cls.__module__.rsplit('.', 1)[-1]}")
        with seeded(seed):
            built = (parts or preset.parts)(task)
        pipeline = preset.pipeline(task) if hasattr(preset, "pipeline") else load_class(cls.pipelines[task])
        return save_tiny(pipeline(**built), Path(out_dir), getattr(preset, "INDEX_NAMES", {}))
