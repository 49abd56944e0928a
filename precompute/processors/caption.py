"""The `caption` processor: choose the .json field, strip captioner boilerplate, add a trigger word.

Captioning models open most captions alike ("The video shows a man ..."); trained on, the phrase
costs tokens and teaches nothing, so `strip_boilerplate` removes one such opening (BOILERPLATE in
vt.shared.chain) and capitalises what follows. `prefix` / `suffix` wrap the result, e.g. a trigger
word in every caption. A sample left without a caption is rejected (missing_caption / empty_caption).
"""

from __future__ import annotations

from dataclasses import replace

from vt.shared.chain import BOILERPLATE, CaptionOptions

from .errors import SampleError
from .sample import Processor, Sample


def strip_boilerplate(text: str) -> str:
    """ "The video shows a red car." -> "A red car."; text without such an opening is returned as is."""
    lower = text.lower()
    for phrase in sorted(BOILERPLATE, key=len, reverse=True):
        if lower.startswith(phrase):
            rest = text[len(phrase) :].lstrip(" ,:;")
            return rest[:1].upper() + rest[1:]
    return text


class Caption(Processor):
    Options = CaptionOptions

    def __call__(self, sample: Sample):
        options = self.options
        if sample.wants_caption and not sample.caption.strip():  # the model captions it later (caption_model)
            yield sample
            return
        text = sample.caption
        if options.field:
            value = sample.meta.get(options.field)
            if not isinstance(value, str):
                raise SampleError(
                    "missing_caption", f"the .json has no text field {options.field!r} (fields: {sorted(sample.meta)})"
                )
            text = value.strip()
        more = [sample.meta.get(name) for name in options.variant_fields]
        more = [value.strip() for value in more if isinstance(value, str) and value.strip()]
        if options.strip_boilerplate:
            text, more = strip_boilerplate(text), [strip_boilerplate(value) for value in more]
        if not text.strip():
            raise SampleError("empty_caption", "nothing is left of the caption")
        wrapped = [f"{options.prefix}{value}{options.suffix}" for value in more]  # its own; others' as they are
        extra = tuple(dict.fromkeys((*sample.extra_captions, *wrapped)))
        yield replace(sample, caption=f"{options.prefix}{text}{options.suffix}", extra_captions=extra)
