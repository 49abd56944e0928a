"""The `caption_model` processor's part in the decode workers: which samples the model captions.

The model itself runs in the producer on its device, in a phase of its own after the chain (captioner.py), batched
over a shard's samples: the workers only mark each sample (`wants_caption`) and let a sample without a caption
through. `fill` marks the samples without one, `replace` and `both` every sample.

A reviewed caption wins: a sample whose .json sidecar was written by `vt-precompute caption` with this captioner
(`"captioner"` equal to `captioner_id(options)`) takes its caption (and in `both` mode the model's, `field`) from
the sidecar, as a person may have edited them, and is not captioned again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from vt.shared.chain import CaptionModelOptions

from .sample import Processor, Sample

REVIEWED = "captioner"  # the sidecar field `vt-precompute caption` names its captioner in


def captioner_id(options: CaptionModelOptions) -> str:
    """What makes the model's captions: the model and every option that changes its text (not `mode`, `field`)."""
    made = options.model_dump(exclude={"mode", "field"})
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16]


class CaptionModel(Processor):
    Options = CaptionModelOptions

    def __call__(self, sample: Sample):
        options = self.options
        given = sample.caption.strip()
        if sample.meta.get(REVIEWED) == captioner_id(options):  # reviewed: the sidecar's text, no model
            caption = sample.meta.get("caption")
            caption = caption.strip() if isinstance(caption, str) else given
            extra = sample.meta.get(options.field) if options.mode == "both" else None
            extra = (extra.strip(),) if isinstance(extra, str) and extra.strip() else ()
            yield replace(sample, caption=caption or (extra[0] if extra else ""), extra_captions=extra)
            return
        yield replace(sample, caption=given, wants_caption=options.mode != "fill" or not given)
