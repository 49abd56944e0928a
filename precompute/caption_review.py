"""`vt-precompute caption CONFIG`: the model's captions written beside the clips, to read and edit before a run.

It runs the configured chain up to `caption_model` (the steps before it, and `decode`) over `data.raw`, captions the
samples with the model as a run would (precompute/captioner.py: same frames, prompt, greedy decoding, cleaning), and
writes each clip's `<key>.json` sidecar next to it, keeping the fields a sidecar had: `"caption"` (`fill`, `replace`:
the caption a run would train on; `both`: the given one), in `both` mode the model's under `field`, and `"captioner"`,
the captioner's identity (processors/caption_model.py `captioner_id`). Nothing is encoded and no window is touched.

An encoding run with the same caption_model then takes each sidecar's captions as they stand (a person may have edited
them) instead of captioning the clip again; a sidecar whose `"captioner"` names other captioner settings, or a clip
without one, is captioned by the model. Works on a folder of media files, local or on object storage (fsspec writes
the sidecar beside the clip); tars and manifests are refused (caption the folder before `vt-precompute pack`). A clip
that the chain splits into several samples is captioned from its first one's frames.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import fsspec

from vt.precompute.media_files import split_key
from vt.precompute.prepare import Prepare
from vt.precompute.processors import bad_data_only, build_chain
from vt.precompute.processors.caption_model import REVIEWED, captioner_id
from vt.precompute.sources import is_media, iter_raw_samples, list_raw_shards, shard_names
from vt.shared.buckets import parse_buckets
from vt.shared.chain import captioner_options
from vt.shared.config import Config
from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.shared.runtime import encoder_dtype, pick_device

log = get_logger("vt.precompute")


@dataclass
class CaptionRun:
    """What `write_caption_sidecars` did: sidecar URLs written, clips rejected by reason."""

    written: list[str]
    rejected: dict[str, int]


def _up_to_captioner(entries: list[dict]) -> list[dict]:
    """The chain's steps up to `caption_model`, less `dedup`: its table lives in a run's window, which a review has
    none of (a copy of a clip is captioned here and rejected by the run that encodes)."""
    at = next(i for i, entry in enumerate(entries) if entry.get("name") == "caption_model")
    return [entry for entry in entries[: at + 1] if entry.get("name") != "dedup"]


def write_caption_sidecars(config: Config) -> CaptionRun:
    """Caption every clip of `data.raw` (a media folder) and write its `.json` sidecar; nothing is encoded."""
    from vt.precompute.captioner import Captioner, apply

    pre = config.precompute
    options = captioner_options(pre.processors)
    if options is None:
        raise UserError(
            "vt-precompute caption needs a caption_model in precompute.processors, e.g. "
            '[{name = "decode"}, {name = "caption_model", model = "Qwen/Qwen2.5-VL-3B-Instruct"}]'
        )
    units = list_raw_shards(config.data.raw)
    if not all(is_media(unit) for unit in units):
        raise UserError(
            f"vt-precompute caption writes sidecars beside media files; data.raw = {config.data.raw!r} holds tars or "
            "a manifest. Caption the folder of clips before packing it (vt-precompute pack)"
        )
    buckets = parse_buckets(config.buckets.sizes)
    prepare = Prepare(build_chain(_up_to_captioner(pre.processors)), buckets, config.buckets.fps, bad_data_only)
    device = pick_device(pre.device)
    from vt.shared.models import spec_for

    captioner = Captioner(options, device, encoder_dtype(device, spec_for(config).frozen_dtype))
    identity = captioner_id(options)
    names = shard_names(units)
    run = CaptionRun([], {})
    pending: list[tuple[str, dict, object]] = []  # (sidecar url, its fields, the clip's first sample)

    def flush() -> None:
        wanted = [sample for _, _, sample in pending if sample.wants_caption]
        with captioner.phase():
            texts = iter(captioner.caption(wanted) if wanted else [])
        for url, fields, sample in pending:
            made = apply(captioner, sample, next(texts)) if sample.wants_caption else sample
            if made is None:
                run.rejected["empty_model_caption"] = run.rejected.get("empty_model_caption", 0) + 1
                continue
            fields = {**fields, "caption": made.caption, REVIEWED: identity}
            if options.mode == "both" and made.extra_captions:
                fields[options.field] = made.extra_captions[-1]
            _write(url, fields)
            run.written.append(url)
        pending.clear()

    for unit in units:
        for raw in iter_raw_samples(unit, names[unit]):
            _, outcome = prepare((0, raw))
            if outcome.samples is None:
                run.rejected[outcome.reason] = run.rejected.get(outcome.reason, 0) + 1
                log.info("caption: skipped %s: %s %s", outcome.key, outcome.reason, outcome.detail)
                continue
            sample = outcome.samples[0]
            fs, path = fsspec.core.url_to_fs(unit)
            url = fs.unstrip_protocol(f"{split_key(path)[0]}.json") if "://" in unit else f"{split_key(path)[0]}.json"
            pending.append((url, raw.meta or {}, sample))
            if len(pending) >= pre.samples_per_shard:
                flush()
    flush()
    return run


def _write(url: str, fields: dict) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(path, (json.dumps(fields, ensure_ascii=False, indent=1) + "\n").encode())
