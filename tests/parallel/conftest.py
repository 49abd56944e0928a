"""Fixtures of the multi-process tests: one precomputed 'keep' window per model family, and one
single-process reference run per family, both built once per session.

Parity needs every layout to see the same samples in the same global batches, so the window holds
a single bucket: global batches never mix buckets, and k micro-batches of B are exactly the samples
of one batch of k x B. The 13 sample clips at batch 4 make steps of 4, 4, 4 and 1 samples: the last
one does not divide over 2 or 4 data-parallel ranks, so every parity run also covers uneven slices
and stand-in samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vt.shared.buckets import Bucket

from helpers.dist_runs import finish, single
from helpers.family_cases import bucket_of

SIDES = (64, 64)  # the frame count is the family's test bucket's (tests/helpers/family_cases.py: 9, Mochi 7 ...)
# Keys sampled at another frame rate than the default 8 fps (MiniMax H3 with audio: its fixed 24 fps).
FPS = {"minimax-h3-audio": 24.0}
# Text of 64 tokens, not Wan's 512: parity compares float sums in other orders, and 512 mostly zero
# keys add rounding to no purpose here (the shipped-config tests run the families' own lengths).
TEXT_TOKENS = 64
# LTX-Video trains fully, Wan with LoRA; a low clip threshold makes clipping act on every Wan step,
# so parity also covers the global gradient norm.
# HunyuanVideo 1.5's LoRA targets on both streams' attention and FFNs.
BOTH_STREAMS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.0.proj", "ff_context.net.2"]
FAMILY_TRAIN = {
    # A full fine-tune with an average of its weights (train/parts/ema.py): every layout's EMA export is compared too.
    "ltx-video": {"mode": "full", "ema": {"decay": 0.5}},
    "wan": {"mode": "lora", "max_grad_norm": 0.05},
    # Both experts in one run (VARIANTS); uniform sigmas shifted by 5 land on both sides of the 0.875 boundary.
    "wan2.2-all": {"mode": "lora", "flow": {"sigma_sampling": "uniform", "shift": 5.0}},
    "wan-i2v": {"mode": "lora", "max_grad_norm": 0.05},  # default targets: attention and the image keys/values
    "hunyuan-video": {"mode": "lora"},  # double and single blocks' attention (the default targets)
    # HunyuanVideo I2V (token_replace): Llava's text of each sample read with its first frame (stage 1, per
    # sample), the clean first latent frame modulated at timestep 0 and weighted 0 in the loss.
    "hunyuan-video-i2v": {"mode": "lora"},
    # The blocks' video attention (the default targets); SD3's "mode" sigmas and cosmap loss weights, so parity
    # also covers a non-default sigma density and a per-sample weighted loss.
    "mochi": {"mode": "lora", "flow": {"sigma_sampling": "mode", "loss_weighting": "cosmap"}},
    "cogvideox-i2v": {"mode": "lora"},  # 32 input channels: the image latents on the channel axis
    # LoRA on both streams' attention and FFNs, so tensor parallel splits adapters of every kind it splits.
    "hunyuan-video-1.5": {
        "mode": "lora",
        "adapter": {"targets": BOTH_STREAMS},
    },
    # Full fine-tune of the video stream, so DDP and FSDP2 also cover its frozen audio stream.
    "ltx-2": {"mode": "full"},
    # LTX-2 with model.audio (VARIANTS): a full fine-tune of both streams (every parameter gets a gradient, so
    # DDP's reducer waits on all), each sample's audio latents and audio noise split with its latents; the audio
    # stream's own sigma per sample (model.audio_timesteps = "independent", shift 3) and cosmap loss weights (each
    # stream's loss weighted by its own sigmas): the audio sigmas split over ranks by sample key.
    "ltx-2-audio": {"mode": "full", "flow": {"loss_weighting": "cosmap"}},
    # bf16 weights on a CPU: the frozen layers stored in bf16 and computed in float32 (per layer in one
    # process, by FSDP2's all-gather when sharded), as a real checkpoint trains there.
    "wan-bf16": {"mode": "lora"},
    # SkyReels V2 diffusion forcing: a sigma per latent frame from each sample's keyed generator, fed as
    # the transformer's (B, F) timestep.
    "skyreels-v2-df": {"mode": "lora"},
    # LTX-Video i2v with a noised conditioning frame, fully fine-tuned: its sigma drawn per sample by the spec, with
    # the first frame's zero loss weight and per-token timesteps splitting over ranks like the latents.
    "ltx-video-i2v": {"mode": "full"},
    # Kandinsky 5 I2V (VARIANTS): one transformer call per sample (no text mask), channel-last input
    # with the image latents as the first frame (weight 0) and its mask channel; LoRA on all blocks' attention.
    "kandinsky5-i2v": {"mode": "lora"},
    # Wan VACE: the default control LoRA on the VACE blocks, which FSDP2 shards as blocks of their own ahead of
    # the main blocks; every sample's control latents split over data-parallel ranks like its latents.
    "wan-vace": {"mode": "lora"},
    # MiniMax H3 with audio (VARIANTS): a full fine-tune of both streams, one packed sequence per sample, each
    # sample's audio latents and audio noise (drawn on a key of its own) split over ranks like its latents.
    "minimax-h3-audio": {"mode": "full"},
    # Kandinsky 6 with audio (VARIANTS): LoRA on every attention of both streams and the cross-stream attentions,
    # each sample's audio latents and noise split over ranks like its latents; its text padded under a mask.
    "kandinsky6-audio": {"mode": "lora"},
}
# Keys above that are not a family: the model section they stand for (a task's own preset).
VARIANTS = {
    "wan-i2v": {"family": "wan", "task": "i2v", "max_text_tokens": 512},  # i2v takes only 512
    "cogvideox-i2v": {"family": "cogvideox", "task": "i2v", "max_text_tokens": TEXT_TOKENS},
    "wan2.2-all": {"family": "wan2.2", "expert": "all", "max_text_tokens": TEXT_TOKENS},
    "wan-bf16": {"family": "wan", "dtype": "bfloat16", "max_text_tokens": TEXT_TOKENS},
    "hunyuan-video-i2v": {"family": "hunyuan-video", "task": "i2v", "max_text_tokens": TEXT_TOKENS},
    "skyreels-v2-df": {"family": "skyreels-v2", "diffusion_forcing": True, "max_text_tokens": TEXT_TOKENS},
    "ltx-video-i2v": {"family": "ltx-video", "task": "i2v", "first_frame_noise": 0.5, "max_text_tokens": TEXT_TOKENS},
    "kandinsky5-i2v": {"family": "kandinsky5", "task": "i2v", "max_text_tokens": TEXT_TOKENS},
    "ltx-2-audio": {
        "family": "ltx-2",
        "audio": True,
        "audio_timesteps": "independent",
        "audio_shift": 3.0,
        "max_text_tokens": TEXT_TOKENS,
    },
    "minimax-h3-audio": {"family": "minimax-h3", "audio": True, "max_text_tokens": TEXT_TOKENS},
    "kandinsky6-audio": {"family": "kandinsky6", "audio": True, "max_text_tokens": TEXT_TOKENS},
}


def bucket_section(key: str) -> dict:
    """The config's buckets section for a FAMILY_TRAIN key: its one bucket, at its frame rate."""
    bucket = Bucket(bucket_of(model_section(key)["family"]).frames, *SIDES)
    return {"sizes": [bucket.name], **({"fps": FPS[key]} if key in FPS else {})}


def model_section(key: str) -> dict:
    """The config's model section for a FAMILY_TRAIN key: a family (text of TEXT_TOKENS) or a variant."""
    return VARIANTS.get(key, {"family": key, "max_text_tokens": TEXT_TOKENS})


@pytest.fixture(scope="session")
def kept_window(tmp_path_factory, tiny_model_factory, raw_shards, request):
    """kept_window(family or variant key) -> (window folder, model folder), precomputed once per session; a
    family that trains on a control video reads the same samples with one each (`control_shards`), a run that
    trains sound (`model.audio`) with a sound track each (`sound_shards`)."""
    from vt.precompute.service import Precompute
    from vt.shared.config import load_config
    from vt.shared.models import get_spec_class

    from helpers.cli_runs import write_config

    built = {}

    def build(family: str):
        if family not in built:
            root = tmp_path_factory.mktemp(f"window-{family}")
            section = model_section(family)
            model = tiny_model_factory(section["family"], task=section.get("task", "t2v"))
            raw = (
                request.getfixturevalue("control_shards")
                if get_spec_class(section["family"]).control_video
                else raw_shards
            )
            raw = request.getfixturevalue("sound_shards") if section.get("audio") else raw
            config = write_config(
                root / "pre.toml",
                model,
                raw,
                root / "pre",
                str(root / "window"),
                model=section,
                buckets=bucket_section(family),
                window={"size": "keep"},
                precompute={"workers": 0},
            )
            Precompute(load_config(config)).run()
            built[family] = (root / "window", model)
        return built[family]

    return build


@pytest.fixture(scope="session")
def run_config(kept_window, raw_shards):
    """run_config(folder, family, name, **settings) -> config path of a 4-sample-batch, one-epoch run; `settings` are
    train keys, or sections by name (validation={"prompts": [...]}) (cli_runs.sectioned)."""
    from helpers.cli_runs import sectioned, write_config

    def make(folder: Path, family: str, name: str, **settings) -> Path:
        window, model = kept_window(family)
        base = {"batch_size": 4, "lr": 1e-3, "epochs": 1, "checkpoint_every": 2}
        train, sections = sectioned({**base, **FAMILY_TRAIN[family]}, settings)
        return write_config(
            folder / f"{name}.toml",
            model,
            raw_shards,
            folder / name,
            str(window),
            model=model_section(family),
            buckets=bucket_section(family),
            window={"size": "keep"},
            train=train,
            log={"progress": False, "samples": True},
            **sections,
        )

    return make


@pytest.fixture(scope="session")
def reference(run_config, tmp_path_factory):
    """reference(family) -> run folder of the single-process run (global batch 4), trained once."""
    runs = {}

    def run(family: str) -> Path:
        if family not in runs:
            folder = tmp_path_factory.mktemp(f"reference-{family}")
            log = folder / "reference.log"
            finish(single(run_config(folder, family, "reference"), log=log), log)
            runs[family] = folder / "reference"
        return runs[family]

    return run
