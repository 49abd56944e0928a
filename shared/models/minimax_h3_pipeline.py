"""vt's handle on diffusers' MiniMax H3 modular pipeline (the `t2va` workflow), the `pipelines` entry of the
`minimax-h3` family (minimax_h3.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vt.shared.caption_table import mask_rows
from vt.shared.models.minimax_h3_layout import TextTokenTypes, pipeline_constants


@dataclass
class H3Output:
    """What the handle returns: `frames` (decoded video, or the latents with output_type "latent"), and the sound."""

    frames: Any
    audio: Tensor | None = None
    sampling_rate: int | None = None


class MiniMaxH3Pipeline:
    """Built from components like a DiffusionPipeline (validation passes the trained transformer), loaded with
    `from_pretrained` from the modular layout, called like one. It runs the pipeline's own blocks; given
    `prompt_embeds` (stage 1's, unpadded) it runs them without the text encoder block, and `output_type="latent"`
    stops before the decode blocks."""

    _parts = (
        "transformer",
        "vae",
        "audio_vae",
        "scheduler",
        "audio_scheduler",
        "text_encoder",
        "tokenizer",
        "processor",
    )

    def __init__(
        self,
        transformer=None,
        vae=None,
        audio_vae=None,
        scheduler=None,
        audio_scheduler=None,
        text_encoder=None,
        tokenizer=None,
        processor=None,
    ):
        from diffusers.modular_pipelines import MiniMaxH3Blocks

        self.modular = MiniMaxH3Blocks().init_pipeline()
        self.modular.update_components(
            **{
                name: value
                for name, value in dict(
                    transformer=transformer,
                    vae=vae,
                    audio_vae=audio_vae,
                    scheduler=scheduler,
                    audio_scheduler=audio_scheduler,
                    text_encoder=text_encoder,
                    tokenizer=tokenizer,
                    processor=processor or TextTokenTypes(),
                ).items()
                if value is not None
            }
        )
        self._progress = {}

    @property
    def components(self) -> dict:
        """name -> part, as a DiffusionPipeline's `components`."""
        return {name: getattr(self, name) for name in MiniMaxH3Pipeline._parts}

    def __getattr__(self, name):
        modular = self.__dict__.get("modular")
        if name in MiniMaxH3Pipeline._parts and modular is not None:
            return getattr(modular, name, None)
        raise AttributeError(name)

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """The t2va components of a MiniMax H3 folder or hub id (modular_model_index.json)."""
        from diffusers.modular_pipelines import ModularPipeline

        modular = ModularPipeline.from_pretrained(str(path), workflow="t2va")
        modular.load_components(**kwargs)
        if getattr(modular, "processor", None) is None:
            modular.update_components(processor=TextTokenTypes())
        pipeline = cls.__new__(cls)
        pipeline.modular, pipeline._progress = modular, {}
        return pipeline

    def save_pretrained(self, out, **_):
        """The modular layout; the processor entry names the real class without files (vt's stand-in is not saved)."""
        self.modular.save_pretrained(str(out), overwrite_modular_index=True)
        index_path = Path(out) / "modular_model_index.json"
        index = json.loads(index_path.read_text())
        if isinstance(self.modular.processor, TextTokenTypes):
            index["processor"] = [
                "transformers",
                "Qwen3VLProcessor",
                {
                    "pretrained_model_name_or_path": None,
                    "revision": None,
                    "subfolder": "processor",
                    "type_hint": ["transformers", "Qwen3VLProcessor"],
                    "variant": None,
                },
            ]
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def set_progress_bar_config(self, **kwargs):
        self._progress = kwargs
        self.modular.set_progress_bar_config(**kwargs)

    @staticmethod
    def save_lora_weights(*args, **kwargs):
        """The modular pipeline's own LoRA writer (MiniMaxH3LoraLoaderMixin), which its `load_lora_weights` reads."""
        from diffusers.loaders import MiniMaxH3LoraLoaderMixin

        return MiniMaxH3LoraLoaderMixin.save_lora_weights(*args, **kwargs)

    def load_lora_weights(self, *args, **kwargs):
        return self.modular.load_lora_weights(*args, **kwargs)

    def _run(self, drop: tuple[str, ...], outputs: list[str], **inputs):
        from diffusers.modular_pipelines import MiniMaxH3Blocks

        blocks = MiniMaxH3Blocks()
        for name in drop:
            blocks.sub_blocks.pop(name)
        pipe = blocks.init_pipeline()
        pipe.update_components(
            **{
                name: getattr(self.modular, name)
                for name in self._parts
                if name in pipe._component_specs and getattr(self.modular, name, None) is not None
            }
        )
        if self._progress:
            pipe.set_progress_bar_config(**self._progress)
        state = pipe(**inputs, output=outputs)
        return [state[name] for name in outputs]

    @torch.no_grad()
    def __call__(
        self,
        prompt=None,
        height=None,
        width=None,
        num_frames=None,
        num_inference_steps=30,
        generator=None,
        max_sequence_length: int = 512,
        prompt_embeds=None,
        prompt_attention_mask=None,
        output_type: str = "np",
        **kwargs,
    ) -> H3Output:
        """One video and its sound (`audio` (1, 2, samples)); `max_sequence_length` truncates the prompt's tokens as
        stage 1 does (the modular pipeline itself never truncates)."""
        drop = ("decode",) if output_type == "latent" else ()
        inputs = dict(
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            generator=generator,
            **kwargs,
        )
        if prompt_embeds is None:
            ids = self.modular.tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_sequence_length]
            inputs["prompt"] = self.modular.tokenizer.decode(ids) if len(ids) == max_sequence_length else prompt
        else:
            rows = mask_rows(prompt_attention_mask)[0] if prompt_attention_mask is not None else prompt_embeds.shape[1]
            drop += ("text_encoder",)
            transformer = self.modular.transformer
            inputs.update(
                prompt_embeds=prompt_embeds[:, :rows].to(transformer.device, transformer.dtype),
                text_token_tags=torch.full((rows,), pipeline_constants().MINIMAX_H3_TEXT_TAG, dtype=torch.long),
            )
        if output_type == "latent":
            return H3Output(*self._run(drop, ["latents", "audio_latents"], **inputs))
        return H3Output(*self._run(drop, ["videos", "audio", "sampling_rate"], output_type=output_type, **inputs))
