"""Stage 1's processor chain as both stages see it: names, typed options, and what goes into provenance.

`precompute.processors` in the config is a list of tables, each `name = ...` plus that processor's
options. A name is a built-in (BUILTINS, the one table of them) or a user class by import path
(`mypkg.module:MyProcessor`). The work itself lives in vt.precompute.processors; this module only
knows the options, because the trainer must compute the same fingerprint from the same config
without importing stage 1 (a user processor's module is imported by both stages, for its options
and version). A built-in's class is named in the table by its import path, as a user's is in the
config, and only stage 1 imports it (`Step.implementation`).

`resolve_chain` validates every entry (an unknown option or a bad value names the processor and the
key) and fills in the core steps a list leaves out, at their place: `sample_frames` (picks the bucket
and the frames' start), `crop` (where the bucket-sized crop sits), `decode` (decodes and fits the
pixels). They run once each, in that order; other processors go anywhere in between (before
`decode` a processor sees metadata and the caption, after it the pixels). The empty list is
today's fixed pipeline: `sample_frames(mode="start")`, `crop(mode="center")`, `decode`.
`describe_chain` is what provenance stores: every step's name, version and every option, defaults
included, so a changed chain is refused by the trainer like a changed VAE.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vt.shared.errors import UserError

CORE_STEPS = ("sample_frames", "crop", "decode")

# Phrases captioning models open with; `caption.strip_boilerplate` removes one at the start.
BOILERPLATE = (
    "the video shows",
    "the video features",
    "the video depicts",
    "the video captures",
    "the video presents",
    "the video showcases",
    "the video begins with",
    "this video shows",
    "this video features",
    "the clip shows",
    "the footage shows",
    "in this video,",
    "in the video,",
    "the scene shows",
    "the image shows",
)


class ProcessorOptions(BaseModel):
    """Base of every processor's options: strict types, unknown keys refused. Subclass it for a user
    processor; VERSION is the processor's behaviour version (bump it when its output changes)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
    VERSION: ClassVar[int] = 1
    # A core step the processor must run before or after ("" for none): `resolve_chain` checks the order.
    BEFORE: ClassVar[str] = ""
    AFTER: ClassVar[str] = ""


class SampleFramesOptions(ProcessorOptions):
    """Which frames, at buckets.fps: from the clip's start, from a start drawn per sample key (seeded),
    every non-overlapping window of the bucket's length, or `windows` windows with starts spread evenly
    from the clip's start to its end (they may overlap on a short clip); several windows are each a
    sample keyed `<key>#w<i>`. Every mode keeps the frame spacing of buckets.fps, so motion speed holds."""

    mode: Literal["start", "random", "all_windows", "uniform"] = "start"
    seed: int = Field(0, ge=0)  # random: the draw depends on (seed, sample key) only
    max_windows: int = Field(0, ge=0)  # all_windows: at most this many per clip (0: every one that fits)
    windows: int = Field(2, ge=1, le=1000)  # uniform: how many windows per clip


class CropOptions(ProcessorOptions):
    """Where the bucket-sized crop sits in the frame scaled to cover the bucket: centered, or at an
    offset drawn per sample key (seeded)."""

    mode: Literal["center", "random"] = "center"
    seed: int = Field(0, ge=0)


class CaptionOptions(ProcessorOptions):
    """The caption: another .json field, captioner boilerplate removed, a prefix (a trigger word) and a suffix; more
    captions of the sample from other .json fields (`variant_fields`)."""

    field: str = ""  # "": the caption the source found (.txt, else .json "caption" / "text")
    strip_boilerplate: bool = False  # drop an opening such as "The video shows" (BOILERPLATE)
    prefix: str = ""  # e.g. "sks style, "
    suffix: str = ""
    # more captions of the sample from other .json fields (a short and a long one ...): each encoded once, the
    # trainer draws one of them and the caption per epoch; a sample without such a field keeps its one caption
    variant_fields: list[str] = Field(default_factory=list)


class CaptionModelOptions(ProcessorOptions):
    """Caption each clip with a vision-language model (transformers' AutoProcessor + AutoModelForImageTextToText),
    greedy, on stage 1's device in a phase of its own after the chain (precompute/captioner.py): `fill` the samples
    without a caption, `replace` every caption, or keep `both` (the given one and the model's, `field` in a sidecar).
    `prompt` may name the given caption as `{caption}`; `strip_boilerplate`, `prefix` and `suffix` apply to the
    model's text as the `caption` processor applies them."""

    model: str = Field(min_length=1)  # a folder or hub id transformers loads
    mode: Literal["fill", "replace", "both"] = "fill"
    field: str = Field("model_caption", min_length=1)  # both: the sidecar field that holds the model's caption
    prompt: str = Field("Describe this video in one sentence.", min_length=1)
    frames: int = Field(4, ge=1, le=64)  # frames shown to the model, evenly spread over the sample's
    max_new_tokens: int = Field(64, ge=1, le=4096)
    batch: int = Field(8, ge=1, le=1024)  # samples per generate call (a shard's are captioned together)
    strip_boilerplate: bool = False
    prefix: str = ""
    suffix: str = ""


class DecodeOptions(ProcessorOptions):
    """Decode the chosen frames scaled to cover the bucket (bilinear antialias), cut the crop."""


class SplitScenesOptions(ProcessorOptions):
    """Cut a video into clips at scene changes (PySceneDetect's ContentDetector over one low-resolution decode),
    each a sample keyed `<key>#s<n>`; scenes shorter than `min_seconds` are dropped, longer than `max_seconds`
    cut into equal pieces (0: no maximum)."""

    BEFORE: ClassVar[str] = "sample_frames"
    threshold: float = Field(27.0, gt=0)  # ContentDetector's: the frame-to-frame change (0-255) that is a cut
    min_seconds: float = Field(1.0, ge=0)
    max_seconds: float = Field(0.0, ge=0)  # 0: no maximum; else at least 2 x min_seconds
    detect_width: int = Field(128, ge=16, le=1024)  # frames are scaled to this width for detection

    @model_validator(mode="after")
    def _pieces_fit(self) -> "SplitScenesOptions":
        if self.max_seconds and self.max_seconds < 2 * self.min_seconds:
            raise ValueError(
                f"max_seconds ({self.max_seconds:g}) must be 0 or at least 2 x min_seconds ({self.min_seconds:g}), "
                "so every piece of a long scene is at least min_seconds"
            )
        return self


class FilterSizeOptions(ProcessorOptions):
    """Reject a clip shorter than `min_seconds` (`too_short`) or smaller than `min_height` x `min_width`
    displayed pixels (`too_small`)."""

    min_seconds: float = Field(0.0, ge=0)
    min_height: int = Field(0, ge=0)
    min_width: int = Field(0, ge=0)


class FilterMotionOptions(ProcessorOptions):
    """Reject a sample whose mean absolute difference between consecutive decoded frames (0-255) is below
    `min_motion` (`too_little_motion`) or above `max_motion` (`too_much_motion`; 0: no maximum)."""

    AFTER: ClassVar[str] = "decode"
    min_motion: float = Field(0.0, ge=0, le=255)
    max_motion: float = Field(0.0, ge=0, le=255)


class FilterBlackOptions(ProcessorOptions):
    """Reject a sample when more than `max_fraction` of its frames are black (mean luma at most `luma`, 0-255)."""

    AFTER: ClassVar[str] = "decode"
    luma: float = Field(16.0, ge=0, le=255)
    max_fraction: float = Field(0.5, ge=0, le=1)


class FilterFrozenOptions(ProcessorOptions):
    """Reject a sample when more than `max_fraction` of its frames repeat the frame before (mean absolute
    difference at most `tolerance`, 0-255)."""

    AFTER: ClassVar[str] = "decode"
    tolerance: float = Field(0.5, ge=0, le=255)
    max_fraction: float = Field(0.5, ge=0, le=1)


class DedupOptions(ProcessorOptions):
    """Reject a clip whose perceptual hash (a DCT hash of `frames` frames spread over it, 64 bits each) is within
    `max_distance` bits of a clip's that claimed it first in the window's storage (`near_duplicate`): one copy
    kept across producers, lanes and resumes."""

    frames: int = Field(4, ge=1, le=64)
    max_distance: int = Field(24, ge=0)  # of frames x 64 bits; unrelated clips differ in about half


@dataclass(frozen=True)
class Builtin:
    """A built-in processor: its options, and the import path of the stage 1 class that runs it
    (a string, so the trainer resolves the options without importing stage 1)."""

    options: type[ProcessorOptions]
    implementation: str


_STAGE1 = "vt.precompute.processors"
BUILTINS: dict[str, Builtin] = {
    "sample_frames": Builtin(SampleFramesOptions, f"{_STAGE1}.sample_frames:SampleFrames"),
    "crop": Builtin(CropOptions, f"{_STAGE1}.crop:Crop"),
    "caption": Builtin(CaptionOptions, f"{_STAGE1}.caption:Caption"),
    "decode": Builtin(DecodeOptions, f"{_STAGE1}.fit_bucket:Decode"),
    "split_scenes": Builtin(SplitScenesOptions, f"{_STAGE1}.split_scenes:SplitScenes"),
    "filter_size": Builtin(FilterSizeOptions, f"{_STAGE1}.filters:FilterSize"),
    "filter_motion": Builtin(FilterMotionOptions, f"{_STAGE1}.filters:FilterMotion"),
    "filter_black": Builtin(FilterBlackOptions, f"{_STAGE1}.filters:FilterBlack"),
    "filter_frozen": Builtin(FilterFrozenOptions, f"{_STAGE1}.filters:FilterFrozen"),
    "dedup": Builtin(DedupOptions, f"{_STAGE1}.dedup:Dedup"),
    "caption_model": Builtin(CaptionModelOptions, f"{_STAGE1}.caption_model:CaptionModel"),
}


@dataclass(frozen=True)
class Step:
    """One resolved step of the chain: its name (built-in or import path), version and options."""

    name: str
    version: int
    options: ProcessorOptions

    @property
    def implementation(self) -> str:
        """The import path of the class that runs the step: a built-in's from BUILTINS, else the name."""
        return BUILTINS[self.name].implementation if self.name in BUILTINS else self.name

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, **self.options.model_dump()}


def load_user_class(path: str) -> type:
    """`package.module:ClassName` -> the class; ValueError saying what is wrong otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"processor {path!r} is neither a built-in ({', '.join(BUILTINS)}) "
            "nor an import path such as 'mypkg.module:MyProcessor'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(
            f"processor {path!r}: cannot import {module_name!r} ({err}); install the package "
            "in both stages' environment or fix the path"
        ) from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not callable(cls):
        raise ValueError(f"processor {path!r}: {module_name} has no class {attr!r}")
    options = getattr(cls, "Options", ProcessorOptions)
    if not (isinstance(options, type) and issubclass(options, ProcessorOptions)):
        raise ValueError(f"processor {path!r}: its Options must subclass vt.shared.chain.ProcessorOptions")
    return cls


def options_class(name: str) -> type[ProcessorOptions]:
    if name in BUILTINS:
        return BUILTINS[name].options
    return getattr(load_user_class(name), "Options", ProcessorOptions)


def _option_problems(name: str, index: int, err: ValidationError, allowed: list[str]) -> str:
    lines = []
    for problem in err.errors(include_url=False):
        key = ".".join(str(part) for part in problem["loc"])
        where = f"processor {index} ({name!r}) option {key!r}"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{where} is unknown; allowed: {', '.join(allowed) or 'none'}")
        else:
            lines.append(f"{where} = {problem['input']!r}: {problem['msg']}")
    return "; ".join(lines)


def _step(index: int, entry: Any) -> Step:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ValueError(f'processor {index} must be a table with a name, e.g. {{name = "crop", mode = "random"}}')
    options = {k: v for k, v in entry.items() if k != "name"}
    cls = options_class(entry["name"])
    try:
        return Step(entry["name"], cls.VERSION, cls.model_validate(options))
    except ValidationError as err:
        raise ValueError(_option_problems(entry["name"], index, err, sorted(cls.model_fields))) from None


def resolve_chain(entries: list[dict[str, Any]]) -> list[Step]:
    """The configured list -> the chain that runs: validated, core steps added at their place."""
    steps = [_step(index, entry) for index, entry in enumerate(entries)]
    names = [step.name for step in steps]
    for core in CORE_STEPS:
        if names.count(core) > 1:
            raise ValueError(f"processor {core!r} is listed {names.count(core)} times; it runs once")
    listed = [name for name in names if name in CORE_STEPS]
    if listed != sorted(listed, key=CORE_STEPS.index):
        raise ValueError(f"processors {listed} are out of order; {' -> '.join(CORE_STEPS)} run in that order")
    for position, core in enumerate(CORE_STEPS):
        if core in names:
            continue
        later = [names.index(c) for c in CORE_STEPS[position + 1 :] if c in names]
        at = min(later) if later else len(steps)
        cls = BUILTINS[core].options
        steps.insert(at, Step(core, cls.VERSION, cls()))
        names.insert(at, core)
    for index, step in enumerate(steps):
        before, after = type(step.options).BEFORE, type(step.options).AFTER
        if (before and index > names.index(before)) or (after and index < names.index(after)):
            where = f"before {before!r}" if before else f"after {after!r}"
            raise ValueError(
                f"processor {step.name!r} must run {where}; list it there (the chain that runs: {' -> '.join(names)})"
            )
    return steps


def captioner_options(entries: list[dict[str, Any]]) -> CaptionModelOptions | None:
    """The chain's `caption_model` options (None without one); it may be listed once."""
    found = [step.options for step in resolve_chain(entries) if step.name == "caption_model"]
    if len(found) > 1:
        raise ValueError(f"processor 'caption_model' is listed {len(found)} times; a sample gets one model caption")
    return found[0] if found else None


def describe_chain(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What provenance stores for the configured chain: each step's name, version and every option."""
    return [step.describe() for step in resolve_chain(entries)]
