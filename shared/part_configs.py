"""The config sections of the training parts (vt.train.parts: one module per option owns its section's meaning,
checks, hooks and memory model), and of the flow-matching objective and validation, which both stages read.

A section here is its keys, types and ranges only; what a key does is its part's (docs/stage2.md lists them).
Keys that lived in [train] or [parallel] before are refused there with their new place (shared/config.py, MOVED).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vt.shared.config_section import Section

# The attention kernels a run may name (vt names; vt.train.attention maps them to diffusers' dispatcher).
ATTENTION_BACKENDS = (
    "native",
    "native_cudnn",
    "native_flash",
    "native_efficient",
    "native_math",
    "flash",
    "flex",
    "xformers",
)
VALIDATION_ATTENTION_BACKENDS = ("", *ATTENTION_BACKENDS, "sage")  # sage: forward only, so inference only


class AdapterConfig(Section):
    """train.mode = "lora": the adapters trained on `targets` (vt.shared.adapters, train/parts/adapter.py): LoRA,
    DoRA (LoRA with a trained magnitude per output), LoHa (Hadamard product) or LoKr (Kronecker product)."""

    kind: Literal["lora", "dora", "loha", "lokr"] = "lora"
    rank: int = Field(16, ge=1)
    alpha: float = Field(16.0, gt=0)
    targets: list[str] = Field(default_factory=list)  # empty: the family's default targets


class FlowConfig(Section):
    """How each sample's sigma is drawn and its loss weighted (train/objectives.py; SD3's schemes as diffusers'
    training_utils names them). `sigma_sampling`, `shift` and `loss_weighting` unset (None): the family's reference
    training recipe's (ModelSpec.flow_recipe; docs/families.md cites each family's)."""

    # logit-normal (`logit_mean`, `logit_std`), LTX-2's stretched logit-normal, uniform, "mode" (`mode_scale`) or
    # "cosmap"; then `shift`
    sigma_sampling: Literal["logit_normal", "stretched_logit_normal", "uniform", "mode", "cosmap"] | None = None
    logit_mean: float = 0.0
    logit_std: float = Field(1.0, gt=0)
    mode_scale: float = Field(1.29, ge=0)
    # The sigmas' shift towards noise (> 1: more). "auto": the family's scheduler's own, at each bucket's size where it
    # shifts by resolution (`use_dynamic_shifting`: LTX-Video, LTX-2), else its fixed `shift` / `flow_shift`.
    shift: float | Literal["auto"] | None = None
    # Each sample's loss weighted by its sigma: none, "sigma_sqrt" (sigma^-2) or "cosmap" (SD3's weightings).
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] | None = None


class ValidationConfig(Section):
    """Validation videos rendered by the training model (train/validation.py); stage 1 stores the prompts'
    conditions (and first / last frames, control videos) in the window."""

    prompts: list[str] = Field(default_factory=list)
    images: list[str] = Field(default_factory=list)  # i2v, flf2v: one first frame per prompt
    last_images: list[str] = Field(default_factory=list)  # flf2v: one last frame per prompt
    # Families that train on a control video: one control video per prompt, fitted to the bucket as stage 1
    # fits a sample's (frames from its start at buckets.fps, scaled to cover, center-cropped).
    videos: list[str] = Field(default_factory=list)
    steps: int = Field(4, ge=1)
    every: int = Field(0, ge=0)  # optimizer steps; 0: only at the end (if prompts are set)
    # Decode with the VAE tiled (vt.shared.vae_tiling): true, false, or "auto" (tiled when the untiled decode would
    # not fit in the GPU memory free at validation; untiled on a CPU).
    vae_tiling: Literal["auto"] | bool = "auto"
    # Validation's attention kernel ("": the training one); may also be an inference-only one ("sage").
    attention_backend: Literal[VALIDATION_ATTENTION_BACKENDS] = ""
    # Each prompt also rendered by the base (a LoRA's adapters switched off; a full fine-tune's step-0 weights), with
    # the same seed and noise, once per run: <run.dir>/validation/base/, beside every step's videos on the run page.
    base: bool = True


class ValidationStackConfig(Section):
    """LoRA files (a turbo or distillation LoRA) stacked on the trained model for one more validation video of each
    prompt, sampled as people sample with them (train/parts/validation_stack.py): does the trained LoRA break them?"""

    loras: list[str] = Field(default_factory=list)  # vt's exports, or files the family's diffusers loader converts
    strengths: list[float] = Field(default_factory=list)  # one per file; empty: 1.0 each
    steps: int | None = Field(None, ge=1)  # the stacked render's sampling steps (None: validation.steps)
    guidance_scale: float | None = Field(None, ge=0)  # the pipeline's guidance scale (None: its default)


class KeepBestConfig(Section):
    """Exports of the `count` best steps kept (train/parts/keep_best.py): by the held-out loss ("held_out") or by a
    metric metrics.jsonl logs (`goal`: "min" or "max" is best); the others' exports deleted, never the newest. 0: off."""

    count: int = Field(0, ge=0)
    by: str = Field("held_out", min_length=1)
    goal: Literal["min", "max"] = "min"


class LRScheduleConfig(Section):
    """The learning rate over optimizer steps (train/parts/lr_schedule.py): a linear warm-up over `warmup_steps`,
    then constant, or decaying to `min_ratio` x train.lr at the run's last step (train.max_steps) linearly or along
    a cosine."""

    warmup_steps: int = Field(0, ge=0)
    decay: Literal["constant", "linear", "cosine"] = "constant"
    min_ratio: float = Field(0.0, ge=0, le=1)


class TokenBudgetConfig(Section):
    """A token budget in place of train.batch_size (train/parts/token_budget.py): each bucket's micro-batch holds as
    many samples as fit this many transformer tokens (at least one), so a small bucket takes a larger batch."""

    tokens_per_batch: int | None = Field(None, ge=1)


class CaptionDropoutConfig(Section):
    """Share of samples trained on the empty caption (classifier-free guidance), drawn per (seed, step, sample)."""

    rate: float = Field(0.0, ge=0, le=1)


class GuidanceConfig(Section):
    """Guidance-distilled bases (MiniMax H3): each target becomes u + w (target - u), u the frozen base's prediction
    for the empty caption (train/parts/guidance.py); w = 1 is plain flow matching. None: off."""

    scale: float | None = Field(None, gt=0)


class HeldOutConfig(Section):
    """The held-out loss over data.eval every `every` optimizer steps and at the end (0 with data.eval: at the end
    only), at each of `sigmas` with fixed noise per sample (train/parts/held_out.py)."""

    every: int = Field(0, ge=0)
    sigmas: list[float] = Field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9], min_length=1)


class EMAConfig(Section):
    """An exponential moving average of the trained weights (train/parts/ema.py): its decay per optimizer step
    (None: off), kept in checkpoints, exported in <run.dir>/ema/; `validation` renders validation with it, `eval`
    computes the held-out loss with it."""

    decay: float | None = Field(None, gt=0, lt=1)
    validation: bool = False
    eval: bool = False


class FrozenBaseConfig(Section):
    """LoRA: how the frozen transformer is stored (train/parts/frozen_base.py). `fp8`: float8 e4m3, upcast layer by
    layer for compute (half the weight memory of bf16). `quantize`: its linear weights quantized as they are read,
    dequantized for each matmul: "nf4" (4-bit NormalFloat, 64-weight blocks: 0.56 bytes a weight) or "int8" (a scale
    per output feature: 1 byte); one process (a sharded layout divides the weights itself)."""

    fp8: bool = False
    quantize: Literal["none", "nf4", "int8"] = "none"


class FP8TrainingConfig(Section):
    """Full fine-tuning: torchao float8 linear layers ("tensorwise" or "rowwise"; CUDA sm89+ only) on the linear
    layers torchao's size filter picks (train/parts/fp8_training.py)."""

    recipe: Literal["none", "tensorwise", "rowwise"] = "none"


class BlockSwapConfig(Section):
    """One GPU: only the first `blocks_on_gpu` blocks' frozen weights stay on it, the others wait in pinned host
    memory and are copied in a block ahead of use (train/parts/block_swap.py). None: every block on the GPU."""

    blocks_on_gpu: int | None = Field(None, ge=0)


class ActivationOffloadConfig(Section):
    """With parallel.activation_checkpointing: the blocks' inputs (and what the layers outside them save) wait in
    pinned host memory between forward and backward (train/parts/activation_offload.py)."""

    enabled: bool = False


class MetricsConfig(Section):
    """Metrics of each validation video, computed beside training (train/parts/video_metrics.py): each with a named
    model of its field (a local folder or a hub id, loaded with transformers' AutoModel / AutoProcessor) or method, off
    while its key is unset. `reference` / `reference_held_out`: video files or folders of training and held-out clips,
    read at the validation videos' size and fps (likeness; `reference` also motion)."""

    clip: str | None = None  # prompt adherence: a CLIP or SigLIP checkpoint
    likeness: str | None = None  # an image encoder (DINOv2, or CLIP): likeness to the references, temporal consistency
    flow: Literal["opencv", "difference"] | None = None  # motion: Farneback optical flow (opencv), or frame difference
    clap: str | None = None  # model.audio: a CLAP checkpoint, the sound against the prompt
    av_offset: bool = False  # model.audio: the sound's lag behind the picture, in ms
    reference: list[str] = Field(default_factory=list)
    reference_held_out: list[str] = Field(default_factory=list)
    frames: int = Field(8, ge=1)  # frames sampled evenly from each video for prompt adherence and likeness
    device: Literal["cpu", "training"] = "cpu"  # where the metric models run ("training": the run's device)
