"""`caption_model`'s model: a vision-language model captions clips on stage 1's device, in a phase of its own.

Loaded once per producer through transformers' auto classes (`AutoProcessor`, `AutoModelForImageTextToText`: Llava,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3 ... by `model`, a folder or hub id; transformers' video processors, which the
Qwen-VL processors include, need torchvision installed), in model.dtype (float32 on a CPU), kept in host memory.
A caption phase (`phase`) copies it onto the device, captions the marked samples of the shards about to be written
(processors/caption_model.py marks them in the decode workers) in batches of `batch`, and drops the device copy
(nothing is copied back: the weights are frozen) before the text encoders and the VAE run, as the text phase does
with an offloaded text encoder (encoders.py, HostCopy). On a CPU nothing moves.

What the model sees: `frames` frames spread evenly over the sample's decoded ones (its bucket's size, the crop the
latents are made of), each an image of one user turn with `prompt` (`{caption}` in it: the given caption), through the
processor's own chat template. Decoding is greedy (no sampling, one beam): the same clip gets the same caption in every
run and producer. The model's text is then cleaned as the `caption` processor cleans one (`strip_boilerplate`,
`prefix`, `suffix`) and set by `mode`: `fill` and `replace` make it the caption, `both` keeps the given caption and
adds the model's as a second caption of the sample (the trainer draws one per epoch). A sample whose model caption
comes out empty, with no given caption, is dropped (counted as `empty_model_caption`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from vt.precompute.encoders import HostCopy, moves_text
from vt.precompute.processors import PreparedSample
from vt.precompute.processors.caption import strip_boilerplate
from vt.shared.chain import CaptionModelOptions
from vt.shared.errors import UserError
from vt.shared.log import get_logger

log = get_logger("vt.precompute")


def frame_indices(total: int, count: int) -> list[int]:
    """`count` indices spread evenly over `total` frames, first and last included (fewer if there are fewer)."""
    if count >= total:
        return list(range(total))
    if count == 1:
        return [0]
    return [round(i * (total - 1) / (count - 1)) for i in range(count)]


class Captioner:
    """The loaded model and processor; `caption(samples)` gives the model's raw text for each sample."""

    def __init__(self, options: CaptionModelOptions, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.options, self.device = options, device
        try:
            self.processor = AutoProcessor.from_pretrained(options.model)
            self.model = AutoModelForImageTextToText.from_pretrained(options.model, dtype=dtype).eval()
        except (OSError, ValueError, ImportError) as err:
            raise UserError(
                f"caption_model: cannot load {options.model!r} as a vision-language model ({type(err).__name__}: "
                f"{err}); set its `model` to a folder or hub id that transformers' AutoProcessor and "
                "AutoModelForImageTextToText load"
            ) from err
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.padding_side = "left"  # generation continues every prompt from its end
        self.host: HostCopy | None = None

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        """The model on the device inside the block, in host memory only after it (its device copy dropped)."""
        if not moves_text(self.device, "model"):
            yield
            return
        if self.host is None:
            self.host = HostCopy(self.model, self.device)
        self.host.to_device()
        try:
            yield
        finally:
            self.host.to_host()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _prompt(self, given: str) -> str:
        content = [{"type": "image"}] * self.options.frames
        text = self.options.prompt.replace("{caption}", given)
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def caption(self, samples: list[PreparedSample]) -> list[str]:
        """The model's text for each sample (greedy), in batches of `batch`; call inside `phase`."""
        out: list[str] = []
        step = self.options.batch
        for start in range(0, len(samples), step):
            group = samples[start : start + step]
            images = []
            for sample in group:
                picked = frame_indices(sample.pixels.shape[1], self.options.frames)
                # A clip shorter than `frames` repeats its last frame, so every prompt shows `frames` images.
                picked += [picked[-1]] * (self.options.frames - len(picked))
                images.append([sample.pixels[:, i] for i in picked])
            inputs = self.processor(
                text=[self._prompt(s.caption) for s in group], images=images, return_tensors="pt", padding=True
            ).to(self.device)
            with torch.inference_mode():
                made = self.model.generate(
                    **inputs, max_new_tokens=self.options.max_new_tokens, do_sample=False, num_beams=1
                )
            new = made[:, inputs["input_ids"].shape[1] :]
            out += [text.strip() for text in self.processor.batch_decode(new, skip_special_tokens=True)]
        return out

    def cleaned(self, text: str) -> str:
        """The model's text as the `caption` processor cleans a caption (boilerplate, prefix, suffix)."""
        options = self.options
        text = strip_boilerplate(text) if options.strip_boilerplate else text
        return f"{options.prefix}{text}{options.suffix}" if text.strip() else ""


def apply(captioner: Captioner, sample: PreparedSample, text: str) -> PreparedSample | None:
    """The sample with the model's `text` set as its mode says; None when it is left without any caption."""
    mode, model = captioner.options.mode, captioner.cleaned(text)
    given = sample.caption
    if mode == "both" and given and model:
        return replace(sample, wants_caption=False, extra_captions=(*sample.extra_captions, model))
    caption = model or (given if mode != "replace" else "")
    return replace(sample, caption=caption, wants_caption=False) if caption else None


def caption_samples(captioner: Captioner, samples: list[PreparedSample]) -> list[PreparedSample | None]:
    """Each sample with the model's caption where the chain asked for it (all in one phase), None for one left
    without a caption."""
    wanted = [i for i, s in enumerate(samples) if s.wants_caption]
    if not wanted:
        return list(samples)
    with captioner.phase():
        texts = captioner.caption([samples[i] for i in wanted])
    out: list[PreparedSample | None] = list(samples)
    for i, text in zip(wanted, texts):
        out[i] = apply(captioner, samples[i], text)
        if out[i] is None:
            log.warning(
                "caption_model: %s got an empty caption from %s; dropped", samples[i].key, captioner.options.model
            )
    return out
