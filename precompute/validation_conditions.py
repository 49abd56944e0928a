"""Stage 1 encodes what validation renders from, so the trainer never loads a text encoder.

Every producer writes the conditions of each validation input (vt.shared.validation_inputs) into the
window before its first commit, as the family pipeline's call takes them; the first copy of each stays.
`vt-precompute prompts CONFIG` does the same for prompts or images added later, loading only the
text (and image) encoders, never the VAE.
"""

from __future__ import annotations

import torch

from vt.shared.log import get_logger
from vt.shared.validation_inputs import encode_conditions, validation_inputs
from vt.shared.video_io import load_image

log = get_logger("vt.precompute")


def text_components(spec) -> list[str]:
    """The stage-1 components that encode prompts and images: all but the VAE."""
    return [name for name in spec.stage1_components if name != "vae"]


@torch.inference_mode()
def write_validation_conditions(
    spec, encoders: dict, config, window, fingerprint: str, storage_dtype: torch.dtype
) -> int:
    """Encode and store every validation input the window lacks for `fingerprint`; returns how many."""
    written = 0
    images, pairs = bool(spec.image_conditions), bool(spec.text_with_image)
    inputs = validation_inputs(config.validation, spec.negative_prompt, images, pairs)
    for item in inputs:
        if window.has_validation(fingerprint, item.key):
            continue
        if item.kind == "prompt":
            tensors = spec.encode_validation_text(encoders, item.value)
        elif item.kind == "pair":  # the prompt read together with its image (`spec.text_with_image`)
            tensors = spec.text_with_image.encode_validation(encoders, item.prompt, load_image(item.value))
        else:
            tensors = spec.image_conditions.encode(encoders, load_image(item.value))
        window.put_validation(fingerprint, item.key, encode_conditions(tensors, storage_dtype))
        written += 1
    if written:
        log.info("validation conditions: %d inputs encoded into %s", written, window.uri)
    return written


def encode_validation_inputs(config) -> int:
    """`vt-precompute prompts`: load the text (and image) encoders alone and store what the window lacks."""
    from vt.shared.models import spec_for
    from vt.shared.provenance import fingerprint, provenance
    from vt.shared.runtime import DTYPES, pick_device
    from vt.shared.window import open_writer

    spec = spec_for(config)
    window = open_writer(config.window.uri, config.window.size)
    device = pick_device(config.precompute.device)
    encoders = {name: spec.load_component(name, device) for name in text_components(spec)}
    return write_validation_conditions(
        spec,
        encoders,
        config,
        window,
        fingerprint(provenance(config, spec=spec)),
        DTYPES[config.precompute.storage_dtype],
    )
