"""Validation videos during training: the family's own diffusers pipeline around the training model itself.

No second copy and no text encoder:
- the pipeline wraps the live transformer (under FSDP2 the sharded one: its forward gathers block by
  block), with the VAE and the other parts it needs, built at the first validation and kept: in host memory
  between validations, on the device during one (`parts_to`);
  tokenizers, text and image encoders stay out;
- each prompt's conditions, and the negative prompt's, come from the window, where stage 1 stored them
  as the pipeline's call takes them (vt.shared.validation_inputs); a trainer whose prompts are not
  there says which command adds them, before the first step;
- every rank takes part: the prompts are dealt to the data-parallel ranks in rounds, ranks of one
  context- or tensor-parallel group render the same prompt, and a rank with no prompt left in a round
  renders a stand-in (the round's first prompt, kept as latents, never decoded or written) so the
  sharded forwards stay in step. The rank at cp = tp = pp = 0 of each group decodes and writes the video.
- under pipeline parallel the stages of a group render the same prompt together: each transformer call
  runs over the stages and every stage gets the last one's prediction (parallel/pp_validation.py).
- besides each prompt's plain video (`<prompt>.mp4`), the parts' renders (`Part.validation_renders`: a stacked
  LoRA's `<prompt>-stacked.mp4`), each inside its own context, every rank entering it alike;
- the base's renders (`validation.base`), once per run in validation/base/ with the same seeds and so the same
  noise: a LoRA's with its adapters switched off (peft's flag, every kind; no second copy), a full fine-tune's
  at step 0. base.json, written last, names what they were rendered with; a later validation, or a resumed
  run, with the same settings reuses them.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch

from vt.shared.adapters import adapters_off
from vt.shared.buckets import Bucket
from vt.shared.config import Config
from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.shared.models.spec import ModelSpec
from vt.shared.vae_tiling import can_tile, decide, free_device_memory, pass_peak, tiling
from vt.shared.validation_inputs import decode_conditions, image_input, pair_input, prompt_input
from vt.shared.video_io import load_image, read_fitted, write_video
from vt.train.parallel.pp_validation import staged_inference
from vt.train.parts.base import Render

log = get_logger("vt.train.validation")
PLAIN = Render("", lambda transformer: contextlib.nullcontext())
BASE_DIR = "base"  # <run.dir>/validation/base/: the base's renders
BASE_RECORD = "base.json"  # what they were rendered with, written last


def video_name(index: int, render: Render) -> str:
    """`00.mp4` for prompt 0's plain video, `00-stacked.mp4` for its render named "stacked"."""
    return f"{index:02d}-{render.name}.mp4" if render.name else f"{index:02d}.mp4"


class MissingConditions(FileNotFoundError):
    """The window holds no conditions for a validation input; the message says how to add them."""


def validation_loads(spec: ModelSpec, config: Config) -> set[str]:
    """The components validation loads from model.path: none without validation prompts, else the pipeline's
    parts but its text and image encoders (stage 1 stored their output); the transformers are the trainer's."""
    if not config.validation.prompts:
        return set()
    return {name for name in set(spec.pipeline_parts()) - set(spec.text_parts()) if not name.startswith("transformer")}


def check_sampling_steps(spec: ModelSpec, steps: int, key: str) -> None:
    """Refuse a number of denoising steps the family's sampler cannot take, at start-up: a scheduler that stretches
    its sigmas to end at `shift_terminal` (a flow-matching config key) divides by zero at one step, and the video (and its
    sound) comes out NaN."""
    terminal = spec.load_config("scheduler").get("shift_terminal") if steps == 1 else None
    if terminal:
        raise UserError(
            f"{key} = 1: {spec.family}'s sampler stretches its noise levels to end at shift_terminal = {terminal}, "
            f"which one step cannot (its video comes out NaN): set {key} = 2 or more"
        )


class Validator:
    def __init__(
        self,
        spec: ModelSpec,
        config: Config,
        bucket: Bucket,
        world,
        window,
        shards,
        autocast: torch.dtype | None = None,
        parts_dtype: torch.dtype | None = None,
        extra_parts=None,
    ):
        """`autocast`: the training's autocast dtype, which validation runs in too (None: float32, as training).
        `parts_dtype`: what the pipeline parts it loads are in (`Dtypes.pipeline_parts`; None: model.dtype).
        `extra_parts()`: pipeline parts the trainer already holds besides the trained transformer (a
        two-expert family's other expert), asked for at the first run. `shards.fingerprint`: the window's shards
        this run takes (train/window_match.py), under which stage 1 stored the validation conditions."""
        self.spec, self.config, self.bucket, self.world = spec, config, bucket, world
        self.window, self.shards = window, shards
        self.autocast, self.parts_dtype = autocast, parts_dtype
        self.extra_parts = extra_parts or dict
        self.prompts = config.validation.prompts
        self.images = [load_image(p) for p in config.validation.images]
        self.last_images = [load_image(p) for p in config.validation.last_images]  # flf2v (config.py checks)
        frames = spec.frame_conditions  # the clip's frames the task conditions on (None: t2v)
        if self.prompts and frames and len(self.images) != len(self.prompts):
            raise UserError(
                f"model.task = {frames.name!r} needs one validation.images entry per validation prompt "
                f"({len(self.prompts)} prompts, {len(self.images)} images)"
            )
        videos = config.validation.videos  # control videos (config.py checks who may set them)
        if self.prompts and spec.control_video and len(videos) != len(self.prompts):
            raise UserError(
                f"{spec.family} trains on a control video, so each validation prompt needs one: set "
                f"validation.videos, one video file per prompt ({len(self.prompts)} prompts, "
                f"{len(videos)} videos)"
            )
        if self.prompts:
            check_sampling_steps(spec, config.validation.steps, "validation.steps")
        # Fitted to the validation bucket as stage 1 fits a sample's control video, once.
        self.controls = [_read_control(path, bucket, config.buckets.fps) for path in videos] if self.prompts else []
        self._conditions: list[dict[str, torch.Tensor]] | None = None
        self._pipeline = None  # built at the first run, around the training model, and kept
        self._tiled: bool | None = None  # whether the VAE decodes tiled, decided at the first run

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    # -- conditions from the window ------------------------------------------------------------------
    def conditions(self) -> list[dict[str, torch.Tensor]]:
        """Per prompt: its conditions, the negative prompt's (named negative_*), its image's and (flf2v) its
        last image's (named last_*), read once. MissingConditions, naming every input the window lacks, if any
        is not there."""
        if self._conditions is None:
            validation = self.config.validation
            images = validation.images if self.spec.image_conditions else []
            last_images = validation.last_images if self.spec.image_conditions else []
            items = [prompt_input(p) for p in self.prompts] + [image_input(path) for path in images]
            items += [image_input(path, "validation.last_images") for path in last_images]
            # A text encoder that reads each prompt with its image (`spec.text_with_image`): one input per pair.
            pairs = (
                [pair_input(*pair) for pair in zip(self.prompts, validation.images)]
                if self.spec.text_with_image
                else []
            )
            items += pairs
            negative = prompt_input(self.spec.negative_prompt)
            stored = {
                item.key: self.window.validation(self.shards.fingerprint, item.key) for item in [*items, negative]
            }
            missing = [self._describe(item) for item in [*items, negative] if stored[item.key] is None]
            if missing:
                raise MissingConditions(
                    f"the window {self.window.uri} holds no conditions for {', '.join(dict.fromkeys(missing))} "
                    f"(shards {self.shards.fingerprint}): stage 1 encodes validation.prompts (and i2v images), so the "
                    "trainer needs no text encoder. Encode them with `vt-precompute prompts CONFIG` (it loads only "
                    "the text encoders), or remove them from the config"
                )
            decoded = {key: decode_conditions(data) for key, data in stored.items()}
            self._conditions = []
            for index, prompt in enumerate(self.prompts):
                merged = {
                    **decoded[prompt_input(prompt).key],
                    **{f"negative_{k}": v for k, v in decoded[negative.key].items()},
                }
                if images:
                    merged.update(decoded[image_input(images[index]).key])
                if last_images:
                    merged.update({f"last_{k}": v for k, v in decoded[image_input(last_images[index]).key].items()})
                if pairs:
                    merged.update(decoded[pairs[index].key])
                self._conditions.append(merged)
        return self._conditions

    def _describe(self, item) -> str:
        if item.kind == "image":
            return f"validation image {item.value}"
        if item.kind == "pair":
            return f"validation prompt {item.prompt!r} with image {item.value}"
        if item.value == self.spec.negative_prompt and item.value not in self.prompts:
            return f"the negative prompt {item.value!r}"
        return f"validation prompt {item.value!r}"

    # -- rendering -----------------------------------------------------------------------------------
    def assignments(self) -> list[int | None]:
        """The prompt this rank renders in each round (None: a stand-in), the same number of rounds on
        every rank: prompts go to data-parallel ranks in turn; cp/tp peers share their dp rank's."""
        dp, dp_rank = self.world.dims.dp, self.world.dp_rank
        rounds = -(-len(self.prompts) // dp)
        return [r * dp + dp_rank if r * dp + dp_rank < len(self.prompts) else None for r in range(rounds)]

    def render(self, transformer, step: int, weights, renders: list[Render] = ()) -> list[Path]:
        """`run` with validation's attention kernel (validation.attention_backend, the training one after) and the
        weights the parts give for validation (`weights`: a context, the EMA's average with ema.validation)."""
        with self._kernel(transformer), weights:
            return self.run(transformer, step, renders)

    def _kernel(self, transformer):
        from vt.train.attention import backend_for

        kernel = self.config.train.attention_backend
        return backend_for(transformer, self.config.validation.attention_backend or kernel, restore=kernel)

    # -- the base's renders --------------------------------------------------------------------------
    @property
    def base_dir(self) -> Path:
        return self.config.run_dir / "validation" / BASE_DIR

    def base_key(self, renders: list[Render]) -> dict:
        """What decides the base's videos: the model, the prompts and their inputs, the sampling, every render."""
        config = self.config
        validation, model = config.validation, config.model
        return {
            "model": [model.path, dict(sorted(model.components.items())), model.dtype, config.train.mixed_precision],
            "inputs": [self.prompts, validation.images, validation.last_images, validation.videos],
            "sampling": [validation.steps, config.train.seed, self.bucket.name, config.buckets.fps],
            "renders": [[r.name, r.steps, [list(a) for a in r.arguments], r.key] for r in renders],
        }

    def stored_base(self) -> dict | None:
        """base.json (None where there is none or it cannot be read)."""
        try:
            return json.loads((self.base_dir / BASE_RECORD).read_text())
        except (OSError, ValueError):
            return None

    def render_base(self, transformer, step: int, renders: list[Render] = ()) -> list[Path]:
        """The base's renders of every prompt (and render) into validation/base/, unless base.json says they are
        there for these settings (every rank calls this; rank 0 reads base.json and tells the others). A LoRA's base
        is the transformer with its adapters switched off, at any step; a full fine-tune's is its weights at step 0,
        so a full fine-tune resumed without them has none (logged)."""
        if not (self.enabled and self.config.validation.base):
            return []
        key = json.loads(json.dumps(self.base_key(renders)))  # as base.json reads back
        stored = self.world.broadcast_object(self.stored_base() if self.world.is_main else None)
        if stored is not None and stored.get("key") == key:
            if self.world.is_main:
                log.info("validation: the base's videos of step %d reused (%s)", stored["step"], self.base_dir)
            return []
        lora = self.config.train.mode == "lora"
        if not lora and step > 0:
            if self.world.is_main:
                log.warning(
                    "validation.base: a full fine-tune's base videos are its step-0 renders, and this run is at "
                    "step %d without them for these settings (%s): the run page shows no base beside its videos",
                    step,
                    self.base_dir,
                )
            return []
        if self.world.is_main:
            shutil.rmtree(self.base_dir, ignore_errors=True)  # another setting's videos
        self.world.barrier()
        with self._kernel(transformer), adapters_off(transformer) if lora else contextlib.nullcontext():
            paths = self.run(transformer, step, renders, out_dir=self.base_dir)
        self.world.barrier()  # every writer is done: then the record
        if self.world.is_main:
            record = self.base_dir / BASE_RECORD
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"step": step, "key": key}, indent=1))
            log.info("validation: the base's videos rendered (%s)", self.base_dir)
        return paths

    @torch.no_grad()
    def run(self, transformer, step: int, renders: list[Render] = (), out_dir: Path | None = None) -> list[Path]:
        """Every rank calls this with the training model; returns the videos this rank wrote (each prompt's plain
        video, then each of `renders`', into `out_dir`, by default validation/step-<step>/)."""
        if not self.enabled:
            return []
        conditions = self.conditions()
        device = str(self.world.device)
        if self._pipeline is None:
            self._pipeline = self.spec.build_pipeline(
                transformer, device=device, text_encoders=False, dtype=self.parts_dtype, **self.extra_parts()
            )
        pipeline = self._pipeline
        parts_to(pipeline, self.world.device)  # (kept in host memory between validations)
        if self._tiled is None:
            self._tiled = self._decode_tiled(pipeline.vae)
        out_dir = out_dir or self.config.run_dir / "validation" / f"step-{step:06d}"
        was_training = transformer.training
        transformer.eval()
        held = hold_no_gathered_weights(transformer)
        paths = []
        try:
            for render in (PLAIN, *renders):
                with render.context(transformer):
                    paths += self._render_prompts(pipeline, transformer, render, conditions, out_dir)
        finally:
            transformer.train(was_training)
            reshard(transformer, held)
            parts_to(pipeline, torch.device("cpu"))  # the device memory goes back to training
        if paths:
            log.info("validation step %d: %d videos in %s", step, len(paths), out_dir)
        return paths

    def _render_prompts(self, pipeline, transformer, render: Render, conditions, out_dir: Path) -> list[Path]:
        """One render of every prompt, this rank's in its rounds (stand-ins where it has none left)."""
        coordinate = self.world.dims.coordinate(self.world.rank)
        writes = coordinate["cp"] == 0 and coordinate["tp"] == 0 and coordinate["pp"] == 0
        decodes = coordinate["pp"] == 0  # the other stages only help denoise
        device = self.world.device
        stages = [transformer, *self.extra_parts().values()]  # under parallel.pp > 1: run over the stages
        paths = []
        for round_index, index in enumerate(self.assignments()):
            shown = index if index is not None else round_index * self.world.dims.dp  # a stand-in: any prompt
            image = self.images[shown] if self.images else None
            extra = {"last_image": self.last_images[shown]} if self.last_images else {}  # flf2v
            if self.controls:  # the prompt's control video
                extra["control"] = self.controls[shown]
            with (
                torch.autocast(device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None),
                staged_inference(stages, device),
                tiling(pipeline.vae, self._tiled),
            ):
                frames, sound = self.spec.generate_clip(
                    pipeline,
                    None,
                    self.bucket,
                    render.steps or self.config.validation.steps,
                    seed=self.config.train.seed + shown,  # the same noise in every render and in the base's
                    image=image,
                    conditions=conditions[shown],
                    decode=index is not None and decodes,
                    **extra,
                    **dict(render.arguments),
                )
            if index is not None and writes:
                path = out_dir / video_name(index, render)
                paths.append(write_video(frames, path, fps=self.config.buckets.fps, sound=sound))
        return paths

    def _decode_tiled(self, vae) -> bool:
        """`validation.vae_tiling`, with "auto" resolved on a GPU: the untiled decode of one clip of the
        validation bucket, traced on fake tensors (what `vt-train plan` counts), against the memory free now."""
        setting = self.config.validation.vae_tiling
        free = free_device_memory(self.world.device) if setting == "auto" else None
        untiled = 0
        if free is not None and can_tile(vae):
            untiled = pass_peak(
                self.spec.empty_component("vae", vae.dtype), "decode", (1, *self.spec.latent_shape(self.bucket))
            )
        tiled, why = decide(setting, untiled, free, can_tile(vae))
        if self.world.is_main:
            log.info(
                "validation decodes %s with the VAE %s (validation.vae_tiling = %s: %s)",
                self.bucket.name,
                "tiled" if tiled else "untiled",
                str(setting).lower(),
                why,
            )
        return tiled


def parts_to(pipeline, device: torch.device) -> None:
    """The validation pipeline's own modules (the VAE, text connectors, an audio VAE and vocoder; not the
    transformers, which are the trainer's) moved to `device`: onto the GPU for a validation, to host memory between
    validations, so training's steps have that memory (what `vt-train plan` counts: host memory, not resident)."""
    for name, module in pipeline.components.items():
        if isinstance(module, torch.nn.Module) and not name.startswith("transformer"):
            module.to(device)


def _read_control(path: str, bucket: Bucket, fps: float):
    """A validation control video fitted to `bucket`; the error names the config key."""
    try:
        return read_fitted(path, bucket, fps)
    except (OSError, ValueError) as err:
        raise UserError(
            f"validation.videos: cannot use {path!r} ({err}); give video files both stages can read"
        ) from err


def hold_no_gathered_weights(model: torch.nn.Module) -> list:
    """Make every FSDP2 module of `model` free its gathered weights right after its forward (training keeps
    the last block's for the backward that follows; inference runs none); returns the modules it changed."""
    from torch.distributed.fsdp import FSDPModule

    changed = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in changed:
        module.set_reshard_after_forward(True)
    return changed


def reshard(model: torch.nn.Module, changed: list) -> None:
    """Back to training's settings (the last block and the root keep their weights after forward) and free
    what inference left gathered."""
    from torch.distributed.fsdp import FSDPModule

    keep = {id(m) for m in _kept_after_forward(model)}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
            if module in changed and id(module) in keep:
                module.set_reshard_after_forward(False)


def _kept_after_forward(model: torch.nn.Module) -> list:
    """The FSDP2 modules training keeps gathered after forward (set in vt.train.parallel.fsdp)."""
    return [m for m in model.modules() if getattr(m, "_vt_keep_after_forward", False)]
