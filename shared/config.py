"""Run configuration: one TOML file for both stages, `--set key=value` overrides, typed validation.

Every section is a dataclass. `load_config` merges the file with overrides, then checks every key
and value against the dataclasses, so a typo or a bad value stops the run at start-up with the key
path and what is allowed, instead of silently doing nothing.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the key and what is allowed."""


@dataclass
class RunSection:
    dir: str = "runs/demo"  # run folder: config.toml, metrics.jsonl, checkpoints, lora, validation


@dataclass
class ModelConfig:
    family: str = "ltx-video"  # a registered Model Spec name (see vt.shared.models)
    path: str = "runs/models/ltx-video-tiny"  # diffusers-layout folder or hub id
    # Per-component overrides: {tokenizer, text_encoder, vae, transformer, scheduler} -> folder/hub id.
    components: dict[str, str] = field(default_factory=dict)
    task: Literal["t2v", "i2v"] = "t2v"  # i2v: first-frame conditioning (families that support it)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # frozen weights' dtype
    max_text_tokens: int = 64
    first_frame_noise: float = 0.0  # i2v: max sigma of the conditioning frame (0 keeps it clean)


@dataclass
class DataConfig:
    raw: str = "runs/data/raw"  # folder, tar file, glob or s3:// prefix of raw webdataset shards


@dataclass
class BucketsConfig:
    sizes: list[str] = field(default_factory=lambda: ["9x64x96", "9x64x64", "9x96x64"])  # FxHxW
    fps: float = 8.0  # frames are sampled at this rate before bucketing


@dataclass
class WindowConfig:
    uri: str = "runs/demo/window"  # local folder or s3://bucket/prefix
    size: Union[int, Literal["keep"]] = 8  # max committed-unconsumed shards; "keep" never evicts
    poll_seconds: float = 0.2
    timeout_seconds: float = 1800.0  # how long a reader or writer waits before giving up


@dataclass
class PrecomputeConfig:
    samples_per_shard: int = 4
    encode_batch: int = 4
    storage_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_consecutive_failures: int = 100
    workers: int = 1  # decode worker processes (0: decode in the encoding process)
    device: str = "auto"


@dataclass
class TrainConfig:
    mode: Literal["lora", "full"] = "lora"
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=list)  # empty: the family's default targets
    batch_size: int = 2  # global samples per optimizer micro-step (all data-parallel ranks)
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    epochs: int = 1  # rolling window: the producer streams the data this many times; "keep": re-read
    max_steps: int = 0  # 0: until the data ends
    seed: int = 0
    sigma_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    shift: float = 1.0
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    checkpoint_every: int = 0  # optimizer steps; 0: only at the end
    validate_every: int = 0  # optimizer steps; 0: only at the end (if prompts are set)
    validation_prompts: list[str] = field(default_factory=list)
    validation_images: list[str] = field(default_factory=list)  # i2v: one conditioning image per prompt
    validation_steps: int = 4
    resume: bool = True  # continue from the newest checkpoint in the run folder
    device: str = "auto"


@dataclass
class LogConfig:
    every_steps: int = 1
    every_seconds: float = 0.0  # 0: by steps only
    wandb: bool = False
    tensorboard: bool = False
    progress: bool = True
    samples: bool = False  # write every step's sample keys to <run.dir>/samples.jsonl (data audits)


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world size
    cp: int = 1
    tp: int = 1
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory
    compile: bool = False  # torch.compile each transformer block


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    buckets: BucketsConfig = field(default_factory=BucketsConfig)
    window: WindowConfig = field(default_factory=WindowConfig)
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)


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
    return build(Config, tree, "")


def build(cls: type, tree: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(tree) - names)
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}' in {where}; allowed: {', '.join(sorted(names))}")
    values = {}
    for name in names & set(tree):
        values[name] = _coerce(hints[name], tree[name], prefix + name)
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<name>=...")
        return build(hint, value, key + ".")
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {list(get_args(hint))}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for option in get_args(hint):
            try:
                return _coerce(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(" or ".join(errors))
    if origin is list:
        (item,) = get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of name = value, got {value!r}")
        _, item = get_args(hint)
        return {k: _coerce(item, v, f"{key}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if not isinstance(value, hint):
        raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def to_toml(config: Config) -> str:
    """Serialise a resolved config back to TOML (written into the run folder)."""
    lines: list[str] = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")
