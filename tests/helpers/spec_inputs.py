"""Seeded inputs and small helpers around a Model Spec that the per-family test files share (each family's
expected values: tests/helpers/family_cases.py)."""

from __future__ import annotations

import hashlib

import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers.family_cases import BUCKET, bucket_of

CAPTIONS = ["a big rabbit walks in the meadow", "people riding bikes on a sunny street"]


def make_spec(folder, family, **kw):
    return build_spec(ModelConfig(family=family, path=str(folder), max_text_tokens=16, **kw), frame_rate=8.0)


def video(batch=2, seed=0, bucket=BUCKET):
    return (
        torch.rand(batch, 3, bucket.frames, bucket.height, bucket.width, generator=torch.Generator().manual_seed(seed))
        * 2
        - 1
    )


def with_control(spec, clip):
    """`encode_video`'s `control=` for a family that trains on a control video (`ModelSpec.control_video`):
    a clip of another seed, the shape of `clip`; {} for the others."""
    if not spec.control_video:
        return {}
    return {"control": video(clip.shape[0], seed=1, bucket=Bucket(*clip.shape[2:]))}


def control_frames(spec, bucket=BUCKET):
    """A pipeline call's `control=` (uint8 frames (F, H, W, 3)) for a family that trains on a control video;
    {} for the others."""
    if not spec.control_video:
        return {}
    frames = torch.randint(
        0,
        256,
        (bucket.frames, bucket.height, bucket.width, 3),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(1),
    )
    return {"control": frames.numpy()}


def stage1(spec, batch=2):
    encoders = spec.load_stage1()
    clip = video(batch, bucket=bucket_of(spec.family))
    return {
        **spec.encode_text(encoders, CAPTIONS[:batch]),
        **spec.encode_video(encoders, clip, **with_control(spec, clip)),
    }


def pipeline_latents(spec, pipeline, image=None):
    """The denoised latents of a 2-step run: finer than uint8 frames for comparing transformers."""
    bucket = bucket_of(spec.family)
    inputs = spec.pipeline_inputs(
        "a rabbit in a meadow", bucket, steps=2, seed=0, image=image, **control_frames(spec, bucket)
    )
    return pipeline(**inputs, output_type="latent").frames.float()


def folder_digest(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.safetensors"))
    }


def first_call(module) -> dict:
    """The keyword arguments of `module`'s first forward call (later calls: classifier-free guidance)."""
    seen: dict = {}

    def record(module, args, kwargs):
        if not seen:
            seen.update(kwargs)

    module.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def capture_transformer_inputs(transformer):
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)

    transformer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def uint8_video(batch=2, seed=0):
    """(video in [-1, 1] as stage 1 makes it from decoded pixels, the uint8 pixels (B, F, H, W, 3))."""
    pixels = torch.randint(
        0,
        256,
        (batch, BUCKET.frames, BUCKET.height, BUCKET.width, 3),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    return pixels.permute(0, 4, 1, 2, 3).float() / 127.5 - 1, pixels


def encode_clip(spec, clip):
    """Stage 1 on a given clip (B, 3, F, H, W) with the first B captions."""
    encoders = spec.load_stage1()
    return {**spec.encode_text(encoders, CAPTIONS[: len(clip)]), **spec.encode_video(encoders, clip)}
