"""What validation renders from, by content: keys of the prompts and images both stages agree on, and the
encoded conditions' file format. The trainer renders validation videos without a text encoder: stage 1
stores each input's conditions in the window (precompute/validation_conditions.py) under
`validation_key`, and the trainer reads them back by the same key (train/validation.py).

Inputs: every `validation.prompts` entry, the family's negative prompt (what its pipeline encodes
for `negative_prompt=None`, for classifier-free guidance) and, for an i2v family whose pipeline runs an
image encoder (Wan 2.1's CLIP), every `validation.images` file and, for first-and-last-frame
(flf2v), every `validation.last_images` file; for a family whose text encoder reads the prompt
together with the image (HunyuanVideo I2V's Llava), every (prompt, image) pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vt.shared.window import validation_key


@dataclass(frozen=True)
class ValidationInput:
    kind: str  # "prompt", "image" or "pair"
    value: str  # the prompt's text, or the image's path (a pair's image)
    key: str  # validation_key of its content
    prompt: str = ""  # a pair's prompt


def prompt_input(text: str) -> ValidationInput:
    return ValidationInput("prompt", text, validation_key("prompt", text.encode()))


def image_input(path: str, key: str = "validation.images") -> ValidationInput:
    """An image by content; `key`: the config list it comes from, named in the error if it cannot be read."""
    try:
        content = Path(path).read_bytes()
    except OSError as err:
        raise FileNotFoundError(f"{key}: cannot read {path!r} ({err}); give image files both stages can read") from err
    return ValidationInput("image", path, validation_key("image", content))


def pair_input(prompt: str, path: str) -> ValidationInput:
    """A prompt read together with an image (`ModelSpec.text_with_image`), by the content of both."""
    image = image_input(path)
    return ValidationInput("pair", path, validation_key("pair", prompt.encode() + b"\0" + image.key.encode()), prompt)


def validation_inputs(validation, negative_prompt: str, images: bool, pairs: bool = False) -> list[ValidationInput]:
    """Every input validation needs conditions of (the config's [validation] section; `images`: whether the
    family encodes its i2v images with a stage-1 encoder; `pairs`: whether its text encoder reads each
    prompt with its image), each once."""
    if not validation.prompts:
        return []
    inputs = [prompt_input(text) for text in dict.fromkeys([*validation.prompts, negative_prompt])]
    if images:
        inputs += [image_input(path) for path in dict.fromkeys(validation.images)]
        inputs += [
            image_input(path, "validation.last_images")
            for path in dict.fromkeys(validation.last_images)
            if path not in validation.images
        ]
    if pairs:
        inputs += [pair_input(*pair) for pair in dict.fromkeys(zip(validation.prompts, validation.images))]
    return inputs


def encode_conditions(tensors: dict[str, torch.Tensor], storage_dtype: torch.dtype) -> bytes:
    """One input's conditions as a safetensors file, floating tensors in the window's storage dtype."""
    from safetensors.torch import save

    stored = {
        name: (t.to(storage_dtype) if t.is_floating_point() else t).contiguous().cpu() for name, t in tensors.items()
    }
    return save(stored, metadata={"format": "vt-validation-conditions"})


def decode_conditions(data: bytes) -> dict[str, torch.Tensor]:
    """The stored conditions as the pipelines take them: embeddings in float32, masks as int64 (as a
    tokenizer's attention mask)."""
    from safetensors.torch import load

    out = {}
    for name, tensor in load(data).items():
        out[name] = (
            tensor.round().long() if "mask" in name else tensor.float() if tensor.is_floating_point() else tensor
        )
    return out
