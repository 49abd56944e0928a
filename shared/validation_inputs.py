"""What validation renders from, by content: keys of the prompts and images both stages agree on, and the
encoded conditions' file format. The trainer renders validation videos without a text encoder: stage 1
stores each input's conditions in the window (precompute/validation_conditions.py) under
`validation_key`, and the trainer reads them back by the same key (train/validation.py).

Inputs: every `train.validation_prompts` entry, the family's negative prompt (what its pipeline encodes
for `negative_prompt=None`, for classifier-free guidance) and, for an i2v family whose pipeline runs an
image encoder (Wan 2.1's CLIP), every `train.validation_images` file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vt.shared.window import validation_key


@dataclass(frozen=True)
class ValidationInput:
    kind: str  # "prompt" or "image"
    value: str  # the prompt's text, or the image's path
    key: str  # validation_key of its content


def prompt_input(text: str) -> ValidationInput:
    return ValidationInput("prompt", text, validation_key("prompt", text.encode()))


def image_input(path: str) -> ValidationInput:
    try:
        content = Path(path).read_bytes()
    except OSError as err:
        raise FileNotFoundError(f"train.validation_images: cannot read {path!r} ({err}); give image files "
                                "both stages can read") from err
    return ValidationInput("image", path, validation_key("image", content))


def validation_inputs(train, negative_prompt: str, images: bool) -> list[ValidationInput]:
    """Every input validation needs conditions of (the config's `train` section; `images`: whether the
    family encodes its i2v images with a stage-1 encoder), each once."""
    if not train.validation_prompts:
        return []
    inputs = [prompt_input(text) for text in dict.fromkeys([*train.validation_prompts, negative_prompt])]
    if images:
        inputs += [image_input(path) for path in dict.fromkeys(train.validation_images)]
    return inputs


def encode_conditions(tensors: dict[str, torch.Tensor], storage_dtype: torch.dtype) -> bytes:
    """One input's conditions as a safetensors file, floating tensors in the window's storage dtype."""
    from safetensors.torch import save

    stored = {name: (t.to(storage_dtype) if t.is_floating_point() else t).contiguous().cpu()
              for name, t in tensors.items()}
    return save(stored, metadata={"format": "vt-validation-conditions"})


def decode_conditions(data: bytes) -> dict[str, torch.Tensor]:
    """The stored conditions as the pipelines take them: embeddings in float32, masks as int64 (as a
    tokenizer's attention mask)."""
    from safetensors.torch import load

    out = {}
    for name, tensor in load(data).items():
        out[name] = tensor.round().long() if "mask" in name else tensor.float() if tensor.is_floating_point() else tensor
    return out
