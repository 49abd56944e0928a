"""The family's own diffusers pipeline: stage 1 encodes text with it, validation samples with it.

What differs between families is data: the call's names for stored conditions (`pipeline_text_names`),
constructor settings (`pipeline_options`), attributes set on the built pipeline (`pipeline_attributes`) and the
call arguments that must match training (`inference_settings`; `inference_mismatches` reports where the
pipeline's defaults differ).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from vt.shared.buckets import Bucket
from vt.shared.errors import UserError
from vt.shared.models.frame_conditions import image_arguments
from vt.shared.models.roles import ImageConditions, TextWithImage
from vt.shared.video_io import Sound


def to_pil_image(image):
    """A PIL image or an (H, W, 3) uint8 array as an RGB PIL image (what image-to-video pipelines take)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"image must be a PIL image or an (H, W, 3) uint8 array, got {array.dtype} {array.shape}")
    return Image.fromarray(array)


def frames_to_pil(frames: Tensor) -> list:
    """(B, 3, H, W) frames in [-1, 1], as stage 1 makes them from decoded pixels (p / 127.5 - 1), back to
    the uint8 RGB images they were decoded from: what an i2v pipeline's image encoder is given."""
    pixels = ((frames.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [to_pil_image(frame) for frame in pixels.permute(0, 2, 3, 1).cpu().numpy()]


def _check_control(control, bucket: Bucket) -> np.ndarray:
    """A control video as (F, H, W, 3) uint8 frames of the bucket's shape, else ValueError saying what it is."""
    frames = np.asarray(control)
    expected = (bucket.frames, bucket.height, bucket.width, 3)
    if frames.shape != expected or frames.dtype != np.uint8:
        raise ValueError(
            f"the control video must be {expected} uint8 frames (bucket {bucket.name}), got "
            f"{frames.dtype} {frames.shape}"
        )
    return frames


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


class PipelineMixin:
    """Uses the spec's `config`, `family`, `pipeline_class()`, `component_names()`, `load_component()`,
    `experts()`, `trained_component`, `check_bucket()`, `encode_text()`, `max_text_tokens`, `control_video`
    and `sound`."""

    # encode_text's condition names -> the pipeline call's (`prompt_embeds=`, ...), where they differ; the
    # negative prompt's are the same names with "negative_" in front.
    pipeline_text_names: ClassVar[dict[str, str]] = {}
    negative_prompt: ClassVar[str] = ""  # what the pipelines encode for negative_prompt=None

    def pipeline_options(self) -> dict[str, Any]:
        """Pipeline constructor arguments that are settings, not components (e.g. an expert boundary)."""
        return {}

    def pipeline_attributes(self) -> dict[str, Any]:
        """Attributes set on a built pipeline where its call has no argument for them (a text length)."""
        return {}

    def pipeline_parts(self) -> list[str]:
        """The pipeline's constructor arguments that are components of this family."""
        names = set(self.component_names())
        return [name for name in inspect.signature(self.pipeline_class().__init__).parameters if name in names]

    def text_parts(self) -> list[str]:
        """The pipeline parts that turn prompts (and i2v images) into conditions: tokenizers, text and image
        encoders. Stage 1 runs them and stores their output in the window, so validation never loads them."""
        prefixes = ("tokenizer", "text_encoder", "image_encoder", "image_processor", "feature_extractor")
        return [name for name in self.pipeline_parts() if name.startswith(prefixes)]

    # ----------------------------------------------------------------------------- stage 1's text
    def _text_pipeline(self, encoders: dict[str, Any]):
        """The family pipeline holding only the given parts (the rest None): its own encode_prompt
        does the encoding, so training conditions match what the pipeline feeds the transformer."""
        return self.pipeline_class()(**{name: encoders.get(name) for name in self.pipeline_parts()})

    def _encode_prompt(self, encoders: dict[str, Any], captions: list[str], **kwargs) -> Any:
        """The family pipeline's own `encode_prompt` over `captions` at this spec's text length, on the
        text encoder's device; `kwargs` go to it as they are."""
        return self._text_pipeline(encoders).encode_prompt(
            list(captions), max_sequence_length=self.max_text_tokens, device=encoders["text_encoder"].device, **kwargs
        )

    def _prompt_and_mask(self, encoders: dict[str, Any], captions: list[str]) -> dict[str, Tensor]:
        """float32 `prompt_embeds` and `prompt_attention_mask` of a pipeline whose `encode_prompt` returns (embeds,
        mask, negative embeds, negative mask), guidance off (LTX-Video, LTX-2, Mochi)."""
        embeds, mask, _, _ = self._encode_prompt(encoders, captions, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float()}

    @torch.no_grad()
    def encode_validation_text(self, encoders: dict[str, Any], prompt: str) -> dict[str, Tensor]:
        """One prompt's conditions (batch of one) as the pipeline's call takes them (`prompt_embeds` ...):
        `encode_text`'s, renamed by `pipeline_text_names`."""
        return {self.pipeline_text_names.get(k, k): v for k, v in self.encode_text(encoders, [prompt]).items()}

    # A family whose i2v pipeline makes conditions of its image with a stage-1 encoder, or whose text encoder reads
    # each caption with the clip's first frame, returns its roles.ImageConditions / roles.TextWithImage for this
    # run's task here; None: it has neither.
    image_conditions: ImageConditions | None = None
    text_with_image: TextWithImage | None = None

    # ----------------------------------------------------------------------------- validation
    def build_pipeline(
        self, transformer, device="cpu", text_encoders: bool = True, dtype: torch.dtype | None = None, **loaded
    ):
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
        parts = {
            name: None if name in left_out else loaded.get(name) or self.load_component(name, device, dtype)
            for name in self.pipeline_parts()
            if name not in trained
        }
        parts.update(trained)
        pipeline = self.pipeline_class()(**parts, **self.pipeline_options())
        pipeline.set_progress_bar_config(disable=True)
        for name, value in self.pipeline_attributes().items():
            setattr(pipeline, name, value)
        return pipeline

    def generate(
        self,
        pipeline,
        prompt: str | None,
        bucket: Bucket,
        steps: int,
        seed: int,
        image=None,
        conditions: dict[str, Tensor] | None = None,
        decode: bool = True,
        last_image=None,
        control=None,
        **pipeline_kwargs,
    ) -> np.ndarray | None:
        """(F, H, W, 3) uint8 frames of one sample from `pipeline` (extra kwargs go to the pipeline).
        `image` / `last_image`: the first (i2v, flf2v) and last (flf2v) frame. `control`: the control video,
        (F, H, W, 3) uint8 at the bucket's size (families with `control_video`). `conditions`: the prompt's (and
        negative prompt's, and images') encoded conditions in the pipeline's names, in place of the prompt (a
        pipeline built without text encoders). `decode=False` stops at the latents (never decoded) and
        returns None: a validation stand-in that only keeps sharded forwards in step."""
        return self.generate_clip(
            pipeline, prompt, bucket, steps, seed, image, conditions, decode, last_image, control, **pipeline_kwargs
        )[0]

    def generate_clip(
        self,
        pipeline,
        prompt: str | None,
        bucket: Bucket,
        steps: int,
        seed: int,
        image=None,
        conditions: dict[str, Tensor] | None = None,
        decode: bool = True,
        last_image=None,
        control=None,
        **pipeline_kwargs,
    ) -> tuple[np.ndarray | None, Sound | None]:
        """`generate`'s frames and, for a run that trains audio (`model.audio`), the sample's sound track
        (`sound.output`); (None, None) with `decode=False`."""
        last = {"last_image": last_image} if last_image is not None else {}  # only flf2v families take one
        if control is not None:  # only families that train on a control video take one
            last["control"] = control
        kwargs = {
            **self.pipeline_inputs(prompt, bucket, steps, seed, image, **last),
            **pipeline_kwargs,
            "output_type": "np" if decode else "latent",
        }
        if conditions is not None:
            kwargs.update(prompt=None, **self.pipeline_conditions(pipeline, conditions))
        output = pipeline(**kwargs)
        if not decode:
            return None, None
        frames = np.asarray(output.frames[0], dtype=np.float32)
        sound = self.sound.output(pipeline, output) if self.config.audio else None
        return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8), sound

    def pipeline_conditions(self, pipeline, conditions: dict[str, Tensor]) -> dict[str, Tensor]:
        """The stored conditions as call arguments of `pipeline` (a family whose pipeline takes one of them
        another way arranges that here)."""
        return conditions

    def pipeline_inputs(
        self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None, last_image=None, control=None
    ) -> dict[str, Any]:
        """The pipeline call arguments `generate` uses: the same text length and frame rate as training,
        for i2v the conditioning image, for flf2v the first and the last frame (`image=`, `last_image=`), for a
        family with `control_video` the control video (`ControlVideo.pipeline_inputs`)."""
        self.check_bucket(bucket)
        kwargs = dict(
            prompt=prompt,
            height=bucket.height,
            width=bucket.width,
            num_frames=bucket.frames,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            **self.inference_settings(),
        )
        images = image_arguments(self.config, self.family, image, last_image)
        kwargs.update({name: to_pil_image(value) for name, value in images.items()})
        if self.control_video:
            if control is None:
                raise UserError(
                    f"{self.family} generation needs a control video ((F, H, W, 3) uint8 frames); set "
                    "validation.videos, one per validation prompt"
                )
            kwargs.update(self.control_video.pipeline_inputs(_check_control(control, bucket)))
        elif control is not None:
            raise UserError(
                f"{self.family} takes no control video; pick a family that trains on one (docs/families.md)"
            )
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
            if default is None or default == value:
                continue
            was = _shown(default) if isinstance(default, (int, float)) else "its own"
            lines.append(
                f"{self.family} trains with {argument}={_shown(value)} but {pipeline} uses {was} by default: "
                f"pass {argument}={_shown(value)} when sampling with the trained weights"
            )
        return lines
