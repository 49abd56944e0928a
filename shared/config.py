"""Run configuration: one TOML file for both stages, `--set key=value` overrides, checked at load.

Every section is a strict pydantic model: each key has a type and an allowed range, and an unknown
key is refused. `load_config` merges the file with the overrides and validates everything at once,
so a typo or a bad value stops the run at start-up, before any model is loaded, with one line per
problem: `<key> = <value>: <what is allowed>`. `to_toml` writes the resolved config back.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import tomli_w
from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator

from vt.shared.buckets import parse_buckets
from vt.shared.chain import resolve_chain
from vt.shared.config_section import Section
from vt.shared.errors import UserError
from vt.shared.part_configs import (
    ATTENTION_BACKENDS,
    ActivationOffloadConfig,
    AdapterConfig,
    BlockSwapConfig,
    CaptionDropoutConfig,
    EMAConfig,
    FlowConfig,
    FP8TrainingConfig,
    FrozenBaseConfig,
    GuidanceConfig,
    HeldOutConfig,
    KeepBestConfig,
    LRScheduleConfig,
    MetricsConfig,
    TokenBudgetConfig,
    ValidationConfig,
    ValidationStackConfig,
)


class ConfigError(UserError):
    """A config problem the user must fix; the message names the key and what is allowed."""


_Section = Section


_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


class RunSection(_Section):
    dir: str = "runs/demo"  # run folder: config.toml, metrics.jsonl, checkpoints, lora, validation

    @field_validator("dir")
    @classmethod
    def _local(cls, value: str) -> str:
        if value.lower().startswith("file://"):
            return value[len("file://") :]
        if _URL.match(value):
            raise UserError(
                "the run folder (checkpoints, metrics, exports, videos) must be a local or mounted "
                "path; object storage is supported for data.raw and window.uri. "
                'Use e.g. run.dir = "runs/my-run"'
            )
        return value


class ModelConfig(_Section):
    family: str = "ltx-video"  # a registered Model Spec name (see vt.shared.models)
    path: str = "runs/models/ltx-video-tiny"  # diffusers-layout folder or hub id
    # Per-component overrides: {tokenizer, text_encoder, vae, transformer, scheduler} -> folder/hub id; a
    # transformer may also be one .safetensors file (original or diffusers layout, fp8-scaled too), local or
    # "org/repo/path/file.safetensors" on the hub, its config read from model.path's transformer folder.
    components: dict[str, str] = Field(default_factory=dict)
    # i2v: first-frame conditioning; flf2v: first and last frame (families that support them)
    task: Literal["t2v", "i2v", "flf2v"] = "t2v"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # frozen weights' dtype
    max_text_tokens: int | None = Field(None, ge=1)  # None: the family's default
    first_frame_noise: float = Field(0.0, ge=0, le=1)  # i2v: max sigma of the conditioning frame (0: clean)
    # Families with several experts (Wan 2.2 A14B: "high_noise", "low_noise"): the one this run trains,
    # on its own noise range; "" is the family's first; "all" trains every expert in one run, each
    # sample by the expert whose range holds its sigma.
    expert: str = ""
    # Diffusion forcing (SkyReels V2's DF checkpoints): an independent noise level per latent frame (per
    # causal block), fed to a transformer that takes a timestep per frame, and validation with the family's
    # diffusion-forcing pipeline; families whose transformer takes one timestep per sample refuse it.
    diffusion_forcing: bool = False
    # Families with a sound stream (ModelSpec.sound: LTX-2, MiniMax H3, Kandinsky 6): train video and audio together,
    # one sigma per sample for both, loss = video loss + audio_weight * audio loss. false: the video stream
    # alone (the audio parameters frozen, out of the optimizer and the checkpoints). Part of the provenance.
    audio: bool = False
    audio_weight: float = Field(1.0, ge=0)
    # With model.audio: the audio stream's noise level per sample. None: the family's default; "shared": the
    # video's, as the family's pipeline pairs the two streams at each step; "independent": drawn on a key of its own
    # (flow.sigma_sampling, at model.audio_shift), for families whose transformer takes a timestep per stream.
    audio_timesteps: Literal["shared", "independent"] | None = None
    audio_shift: float | None = Field(None, gt=0)  # the independent audio sigmas' shift; None: the family's default


class DataConfig(_Section):
    raw: str = "runs/data/raw"  # folder, tar file, glob or s3:// prefix of raw webdataset shards
    # Families that train on a control video per sample (ModelSpec.control_video): the member holding it,
    # `<key>.<control>.mp4` in a tar (`<stem>.<control>.mp4` beside a media file); e.g. "pose" or "depth"
    # where the data holds several. Part of the shards' provenance.
    control: str = "control"
    # model.audio: a clip without a sound track is skipped (listed in rejects.jsonl as `missing_audio`) or
    # trained on silence. Part of the shards' provenance.
    missing_audio: Literal["skip", "silence"] = "skip"
    # Held-out raw data (as `raw`: a folder, tar, glob, s3:// prefix or manifest), encoded by vt-precompute into the
    # window's eval/ prefix and never trained on: the trainer's held-out loss (held_out.every, train/parts/held_out.py).
    eval: str | None = None

    @field_validator("control")
    @classmethod
    def _member(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", value):
            raise UserError(
                "must be a member name of letters, digits, '_' or '-' (no dots or slashes): the "
                'control video of sample <key> is <key>.<name>.mp4, e.g. data.control = "pose"'
            )
        return value


def _bucket_size(text: str) -> str:
    try:
        parse_buckets([text])
    except ValueError:
        raise ValueError('must look like FRAMESxHEIGHTxWIDTH with positive integers, e.g. "9x64x96"') from None
    return text


class BucketsConfig(_Section):
    sizes: list[Annotated[str, AfterValidator(_bucket_size)]] = Field(
        default_factory=lambda: ["9x64x96", "9x64x64", "9x96x64"], min_length=1
    )  # FxHxW
    fps: float = Field(8.0, gt=0)  # frames are sampled at this rate before bucketing


class WindowConfig(_Section):
    uri: str = "runs/demo/window"  # local folder or s3://bucket/prefix
    size: Union[int, Literal["keep"]] = 8  # max committed-unconsumed shards; "keep" never evicts
    poll_seconds: float = Field(0.2, gt=0)
    timeout_seconds: float = Field(1800.0, gt=0)  # how long a reader or writer waits before giving up

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if value == "keep" or (type(value) is int and value >= 1):
            return value
        raise ValueError('must be an integer >= 1 or "keep"')


class PrecomputeConfig(_Section):
    samples_per_shard: int = Field(4, ge=1)
    encode_batch: int = Field(4, ge=1)
    storage_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_consecutive_failures: int = Field(100, ge=1)
    workers: int = Field(1, ge=0)  # decode worker processes (0: decode in the encoding process)
    # Where the decode chain runs (precompute/ray_pool.py): "local" worker processes (`workers`), or "ray", a pool of
    # `ray_actors` actors on the Ray cluster RAY_ADDRESS names (0: one per CPU of the cluster); a clip runs again on a
    # fresh actor when its actor dies or passes `ray_timeout_seconds`, and is rejected after `ray_tries` actors.
    engine: Literal["local", "ray"] = "local"
    ray_actors: int = Field(0, ge=0)
    ray_tries: int = Field(3, ge=1)
    ray_timeout_seconds: float = Field(600.0, gt=0)
    # Producers share a window's raw shards by claiming lanes (precompute/lanes.py): `lanes` fixed slices of the raw
    # shards, set by the window's first producer (None: torchrun's WORLD_SIZE, a Slurm array's task count, else 1).
    # A lane whose holder fell silent for `claim_seconds` (or whose process is gone from this host and pid namespace) is
    # taken over.
    lanes: int | None = Field(None, ge=1)
    claim_seconds: float = Field(60.0, gt=0)
    device: str = "auto"
    # Where the text (and image) encoders live (precompute/encoders.py): "none" on the device beside the VAE;
    # "model" in page-locked host memory, copied onto the device for each text phase; "blocks" streamed block by
    # block from CPU memory (an encoder larger than the GPU).
    text_encoder_offload: Literal["none", "model", "blocks"] = "none"
    # Full shards whose new captions one text phase encodes together (their decoded clips wait in host memory
    # meanwhile, uint8, uncommitted): with text_encoder_offload = "model" the encoders cross to the device once per
    # this many shards; with "blocks" their new captions are one call of the family's text encoding (one streaming
    # pass where the family batches captions); with "none" it does nothing (warned).
    text_phase_shards: int = Field(1, ge=1)
    # Encode clips in overlapping tiles (vt.shared.vae_tiling): true, false, or "auto" (the buckets whose untiled
    # encode would not fit in the GPU memory free). `true` is part of the shards' provenance.
    vae_tiling: Literal["auto"] | bool = "auto"
    # The processor chain (vt.shared.chain): tables of `name` plus options; [] is the default chain.
    processors: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("processors")
    @classmethod
    def _chain(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        resolve_chain(value)  # every option checked at load; the error names the processor and the key
        return value


class TrainConfig(_Section):
    """The run itself: what trains, the batch, the optimizer, checkpoints. Each option that changes the model, the
    step or memory has a section of its own (shared/part_configs.py, its part in vt.train.parts)."""

    mode: Literal["lora", "full"] = "lora"  # "lora": the [adapter] section's adapters; "full": every weight
    batch_size: int = Field(2, ge=1)  # global samples per optimizer micro-step (all data-parallel ranks)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)  # the peak rate ([lr_schedule]: warm-up and decay)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)  # 0: no clipping
    epochs: int = Field(1, ge=1)  # rolling window: the producer streams the data this many times; "keep": re-read
    max_steps: int = Field(0, ge=0)  # 0: until the data ends
    # Batches read and decoded in the background while the model steps, at most this many MiB of this rank's
    # rows (and 4 x grad_accum batches) ahead of the one in use; 0: read each batch when it is needed
    read_ahead_mb: int = Field(256, ge=0)
    seed: int = Field(0, ge=0)
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    checkpoint_every: int = Field(0, ge=0)  # optimizer steps; 0: only at the end
    resume: bool = True  # continue from the newest checkpoint in the run folder
    device: str = "auto"
    # Attention kernel through diffusers' dispatcher (vt.train.attention): "native" (torch SDPA picks),
    # "native_cudnn" / "native_flash" / "native_efficient" / "native_math" (one SDPA kernel), "flash"
    # (the flash-attn package), "flex", "xformers"; checked against this machine at start-up.
    attention_backend: Literal[ATTENTION_BACKENDS] = "native"


class LogConfig(_Section):
    every_steps: int = Field(1, ge=1)
    every_seconds: float = Field(0.0, ge=0)  # 0: by steps only
    wandb: bool = False
    tensorboard: bool = False
    progress: bool = True
    samples: bool = False  # write every step's sample keys to <run.dir>/samples.jsonl (data audits)
    # "debug" also shows vt's debug lines and the libraries' own progress bars and notices (transformers'
    # "Loading weights", diffusers' pipeline loading ...), hidden otherwise (vt.shared.log.quiet_libraries)
    level: Literal["info", "debug"] = "info"
    report_every_seconds: float = Field(30.0, ge=0)  # <run.dir>/report.html at a log interval, at most this often


class ParallelConfig(_Section):
    dp_replicate: int = Field(1, ge=1)
    # "auto": replicate (DDP) when the memory plan says the whole model fits each device, else -1
    # (train/parallel/layout.py); -1: whatever is left of the world size; an integer: that degree.
    dp_shard: Union[int, Literal["auto"]] = "auto"
    cp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    # Pipeline parallel: the transformer's blocks split into `pp` stages (train/parallel/pp.py), run by
    # torch.distributed.pipelining's GPipe or 1F1B schedule over one-sample microbatches.
    pp: int = Field(1, ge=1)
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory
    compile: bool = False  # torch.compile each transformer block
    # FSDP2 keeps parameters, gradients and optimizer state in CPU memory and the optimizer steps on
    # the CPU (CPUOffloadPolicy); one process shards over a group of one, so a single GPU can use it.
    cpu_offload: bool = False

    @field_validator("dp_shard", mode="before")
    @classmethod
    def _auto_rest_or_positive(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and (value == -1 or value >= 1)):
            return value
        raise ValueError(
            'must be "auto" (replicate if the model fits each device, else shard), '
            "-1 (the rest of the world size) or >= 1"
        )


class Config(_Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    buckets: BucketsConfig = Field(default_factory=BucketsConfig)
    window: WindowConfig = Field(default_factory=WindowConfig)
    precompute: PrecomputeConfig = Field(default_factory=PrecomputeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    # the training parts' sections (vt.train.parts)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    token_budget: TokenBudgetConfig = Field(default_factory=TokenBudgetConfig)
    caption_dropout: CaptionDropoutConfig = Field(default_factory=CaptionDropoutConfig)
    guidance: GuidanceConfig = Field(default_factory=GuidanceConfig)
    held_out: HeldOutConfig = Field(default_factory=HeldOutConfig)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    frozen_base: FrozenBaseConfig = Field(default_factory=FrozenBaseConfig)
    fp8_training: FP8TrainingConfig = Field(default_factory=FP8TrainingConfig)
    block_swap: BlockSwapConfig = Field(default_factory=BlockSwapConfig)
    activation_offload: ActivationOffloadConfig = Field(default_factory=ActivationOffloadConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    validation_stack: ValidationStackConfig = Field(default_factory=ValidationStackConfig)
    keep_best: KeepBestConfig = Field(default_factory=KeepBestConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)


# Keys that moved to a section of their own: old dotted key -> its new place. A config that still sets one is refused
# with one line naming where it went (`moved_keys`).
MOVED = {
    "train.adapter": "adapter.kind",
    "train.lora_rank": "adapter.rank",
    "train.lora_alpha": "adapter.alpha",
    "train.lora_targets": "adapter.targets",
    "train.warmup_steps": "lr_schedule.warmup_steps",
    "train.tokens_per_batch": "token_budget.tokens_per_batch",
    "train.sigma_sampling": "flow.sigma_sampling",
    "train.logit_mean": "flow.logit_mean",
    "train.logit_std": "flow.logit_std",
    "train.mode_scale": "flow.mode_scale",
    "train.shift": "flow.shift",
    "train.loss_weighting": "flow.loss_weighting",
    "train.caption_dropout": "caption_dropout.rate",
    "train.guidance_scale": "guidance.scale",
    "train.eval_every": "held_out.every",
    "train.eval_sigmas": "held_out.sigmas",
    "train.ema_decay": "ema.decay",
    "train.ema_validation": "ema.validation",
    "train.ema_eval": "ema.eval",
    "train.validate_every": "validation.every",
    "train.validation_prompts": "validation.prompts",
    "train.validation_images": "validation.images",
    "train.validation_last_images": "validation.last_images",
    "train.validation_videos": "validation.videos",
    "train.validation_steps": "validation.steps",
    "train.validation_vae_tiling": "validation.vae_tiling",
    "train.validation_attention_backend": "validation.attention_backend",
    "train.fp8_base_weights": "frozen_base.fp8",
    "train.quantize_base": "frozen_base.quantize",
    "train.fp8_training": "fp8_training.recipe",
    "parallel.blocks_on_gpu": "block_swap.blocks_on_gpu",
    "parallel.activation_offload": "activation_offload.enabled",
}


def moved_keys(tree: dict) -> list[str]:
    """One line per key of `tree` (a config's TOML tables) that moved to another section: its old and new place."""
    lines = []
    for old, new in MOVED.items():
        section, key = old.split(".")
        if isinstance(tree.get(section), dict) and key in tree[section]:
            lines.append(f"{old} moved to {new}: set {new} = {tree[section][key]!r} instead (docs/stage2.md)")
    return lines


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); value is read as TOML, else kept as a plain string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}. Example: --set window.size=8")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def _merge(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {part!r} is a value, not a section")
        tree = node
    tree[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML run config, apply `key=value` overrides, validate into a `Config`."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist. Try configs/demo.toml")
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path} is not valid TOML: {err}") from err
    for text in overrides:
        _merge(tree, *parse_override(text))
    config = build(Config, tree, "")
    check_last_images(config)
    check_validation_videos(config)
    return config


def check_validation_videos(config: Config) -> None:
    """`validation.videos` holds one control video per validation prompt, for a family that trains on
    a control video (`ModelSpec.control_video`) only: at start-up, not at validation. (Such a family's
    prompts without videos are refused where the trainer builds its validation, which knows the family
    without importing it here for every config.)"""
    family, validation = config.model.family, config.validation
    if not validation.videos:
        return
    if not _takes_control_video(family):
        raise ConfigError(
            f"validation.videos = {validation.videos!r}: model.family = {family!r} trains "
            "on no control video, so validation has no use for them; remove it (the families with "
            "control videos: docs/families.md)"
        )
    prompts, videos = len(validation.prompts), len(validation.videos)
    if videos != prompts:
        raise ConfigError(
            f"validation.videos has {videos} entries for {prompts} validation.prompts: "
            f"model.family = {family!r} renders each prompt under a control video (pose, depth ...); "
            "give one video file per prompt (the same file may repeat)"
        )


def _takes_control_video(family: str) -> bool:
    from vt.shared.models import get_spec_class  # here, not at the top: the registry imports this module

    try:
        return get_spec_class(family).control_video
    except ValueError:  # an unknown family: refused with its own message where the spec is built
        return False


def check_last_images(config: Config) -> None:
    """`validation.last_images` is for model.task = "flf2v" only, one per validation prompt: a list of
    the wrong length, or one that a task would ignore, stops the run at start-up rather than at validation."""
    task, validation = config.model.task, config.validation
    if task != "flf2v":
        if validation.last_images:
            raise ConfigError(
                f"validation.last_images = {validation.last_images!r}: only model.task = "
                f'"flf2v" (first and last frame) takes last frames, this run\'s task is {task!r}; '
                'remove it, or set model.task = "flf2v"'
            )
        return
    prompts, last = len(validation.prompts), len(validation.last_images)
    if last != prompts:
        raise ConfigError(
            f"validation.last_images has {last} entries for {prompts} validation.prompts: "
            'model.task = "flf2v" needs one last-frame image per validation prompt (and one '
            "validation.images entry for its first frame)"
        )


def build(cls: type[BaseModel], tree: dict, prefix: str = "") -> Any:
    """Validate `tree` into `cls`; every problem becomes one line of a `ConfigError`, keys shown under `prefix`."""
    moved = moved_keys(tree) if cls is Config else []
    if moved:
        raise ConfigError("\n".join(moved))
    try:
        return cls.model_validate(tree)
    except ValidationError as err:
        lines = [_describe(cls, prefix, problem) for problem in err.errors(include_url=False)]
        raise ConfigError("\n".join(lines)) from None


def to_toml(config: Config) -> str:
    """Serialise a resolved config back to TOML (written into the run folder); unset keys are left out."""
    return tomli_w.dumps(config.model_dump(exclude_none=True))


# -- turning pydantic's errors into `<key> = <value>: <what is allowed>` --------------------------------

_TYPES = {
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "string_type": "must be a string (in quotes)",
    "list_type": 'must be a list, e.g. ["a", "b"]',
    "dict_type": "must be a table of name = value",
    "too_short": "must not be empty",
}
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _describe(cls: type[BaseModel], prefix: str, problem: dict) -> str:
    loc, kind, ctx = problem["loc"], problem["type"], problem.get("ctx", {})
    key = prefix + _path(loc)
    if kind == "extra_forbidden":
        _, section = _lookup(cls, loc[:-1])
        where = (prefix + _path(loc[:-1])) or "the top level"
        return f"unknown key '{key}' in {where}; allowed: {', '.join(sorted(section.model_fields))}"
    info = _lookup(cls, loc)[0]
    if kind in ("model_type", "model_attributes_type"):
        allowed = f"must be a section (a table); set its keys, e.g. {key}.<name>=..."
    elif kind == "literal_error" and info is not None:
        allowed = f"choose one of {list(get_args(info.annotation))}"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        # the field's whole range, not just the bound that failed: "must be >= 0 and <= 1"
        holders = info.metadata if info is not None else [ctx]
        allowed = "must be " + " and ".join(
            f"{sign} {_bound(h, name)}" for h in holders for name, sign in _BOUNDS if _bound(h, name) is not None
        )
    elif kind == "value_error":
        allowed = str(ctx["error"])
    else:
        allowed = _TYPES.get(kind, problem["msg"])
    return f"{key} = {problem['input']!r}: {allowed}"


def _bound(holder: Any, name: str) -> Any:
    """A bound (ge, gt, le, lt) from a field's constraint object or an error's ctx dict; None if absent."""
    return holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)


def _path(loc: tuple) -> str:
    """("buckets", "sizes", 1) -> "buckets.sizes[1]"."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _lookup(cls: type[BaseModel], loc: tuple) -> tuple[Any, Any]:
    """(the field at `loc` below `cls`, the type it holds), or (None, None) if `loc` is not a field."""
    info, held = None, cls
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(held, type) and issubclass(held, BaseModel)) or part not in held.model_fields:
            return None, None
        info = held.model_fields[part]
        held = info.annotation
    return info, held
