"""What made a latent shard: the settings both stages must agree on, and its fingerprint.

The producer stores the provenance in every shard and its fingerprint in every commit record; the
trainer computes the same from its own config and refuses shards whose fingerprint differs, naming
the settings that differ (`describe_difference`), so a cache never goes stale silently.

What goes in: the model family and task, the encoders' weights (a digest of the tokenizer, text
encoder and VAE files), the processing (frame rate, bucket table, and the processor chain: every
step's name, version and options, defaults included; for a family that trains on a control video, the
member it is read from, `data.control`; for a run that trains audio, `model.audio`, the sound's rate and
channels and `data.missing_audio`, and the audio encoder among the weights), the text length, encoder
and storage dtypes, and the shard format version. A run without audio records none of it, so its
shards and fingerprint are what they were before audio existed.
Not in: anything only the trainer uses (transformer, LoRA, learning rate ...).

Stage 1 computes the fingerprint; a trainer takes it from the window's shards and checks the encoders it
never loads by what stage 1 recorded of them beside it (`component_records`, train/window_match.py).

The weights digest reads files, never loads a model, and remembers each big file's digest by its path,
size and modification time (cached_file_digest), so a start of either stage hashes nothing it has hashed
before. Files up to FULL_HASH_BYTES are hashed whole.
Bigger ones (a 10 GB text encoder would take seconds to hash at every start of both stages) are
hashed by their size, their first HEAD_BYTES (for safetensors: the whole header, which names every
tensor with its dtype, shape and offsets) and SAMPLE_COUNT blocks of SAMPLE_BYTES spread evenly over
the rest. The trade-off: a change confined to bytes between the sampled blocks, with the same size
and header, goes unnoticed. Fine-tuning or re-saving a model changes nearly every block, so real
changes are caught; a single hand-edited value in a big file is not. Bump a processor's
VERSION (its options class) when its behaviour changes, PROCESSING_VERSION when anything else in
stage 1 does, so old caches are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from vt.shared.chain import describe_chain
from vt.shared.config import Config
from vt.shared.shards import FORMAT_VERSION

# Bump when stage 1 changes what a shard holds outside any one processor (a processor's own change
# bumps its VERSION, vt.shared.chain). 2: display aspect, sample ids "<raw shard>/<key>"; 3: the
# processor chain (each step's name, version and options) replaces the fixed fit / frame sampling.
PROCESSING_VERSION = 3

FULL_HASH_BYTES = 64 * 2**20
HEAD_BYTES = 2**20
SAMPLE_COUNT = 64
SAMPLE_BYTES = 64 * 2**10
CACHE_MIN_BYTES = 2**20  # smaller files are hashed at every start (see cached_file_digest)


def provenance(config: Config, weights: dict[str, str] | None = None, spec=None) -> dict:
    """The settings that decide a shard's content. `weights` (component -> digest) defaults to
    `weights_digests(spec)`; `spec` (the config's Model Spec) is built when not given."""
    from vt.shared.models import spec_for
    from vt.shared.models.frame_conditions import task_of

    spec = spec or spec_for(config)
    return {
        "format_version": FORMAT_VERSION,
        "family": config.model.family,
        "task": task_of(config.model),
        "max_text_tokens": spec.max_text_tokens,  # resolved: the family's default when unset
        "encoder_dtype": config.model.dtype,
        "storage_dtype": config.precompute.storage_dtype,
        "processing": {
            "version": PROCESSING_VERSION,
            "fps": config.buckets.fps,
            "buckets": sorted(config.buckets.sizes),
            "processors": describe_chain(config.precompute.processors),
            **({"vae_tiling": True} if config.precompute.vae_tiling is True else {}),
            # which member of each sample holds its control video (a family that trains on one)
            **({"control": config.data.control} if spec.control_video else {}),
            # model.audio: the sound stored beside the latents (shards without it are refused)
            **({"audio": audio_settings(config, spec)} if config.model.audio else {}),
        },
        "weights": dict(sorted((weights if weights is not None else weights_digests(spec)).items())),
    }


def audio_settings(config: Config, spec) -> dict:
    """What decides a shard's `audio_latents`: the family's sound format and what a clip without sound gets."""
    audio = spec.sound.format()
    return {"sample_rate": audio.sample_rate, "channels": audio.channels, "missing": config.data.missing_audio}


def fingerprint(prov: dict) -> str:
    return hashlib.sha256(json.dumps(prov, sort_keys=True).encode()).hexdigest()[:16]


def weights_digests(spec) -> dict[str, str]:
    """component -> digest of its files, for the components stage 1 runs (no weights are loaded)."""
    return {name: record["digest"] for name, record in component_records(spec).items()}


def component_records(spec) -> dict[str, dict]:
    """component -> {"digest", "source", "files", and "revision" for a hub snapshot}, for the components
    stage 1 runs: the digest goes into the provenance (the fingerprint); the rest is stored beside it in every
    shard (`meta["sources"]`), so a trainer that never loads a component can still check it without reading
    a byte of it: by its files' names and sizes where they are on its disk, else by where they came from
    (train/window_match.py)."""
    return {name: component_record(spec, name) for name in spec.stage1_components}


CAPTIONER = "captioner"  # the weights name of caption_model's vision-language model (beside the encoders)


def captioner_records(config: Config) -> dict[str, dict]:
    """{"captioner": record} of the chain's caption_model (its `model` folder or hub snapshot), else {}: it joins the
    encoders' digests and records, so a window captioned by other weights under the same name is refused."""
    from vt.shared.chain import captioner_options

    options = captioner_options(config.precompute.processors)
    if options is None:
        return {}
    return {CAPTIONER: folder_record(options.model, None, lambda: _snapshot(options.model, None, None))}


def component_record(spec, name: str) -> dict:
    path, subfolder = spec.source(name)
    return folder_record(path, subfolder, lambda: local_folder(spec, name))


def folder_record(path: str, subfolder: str | None, locate) -> dict:
    """{"digest", "source", "files"[, "revision"]} of the model files at `path`[/`subfolder`] (`locate()` finds them)."""
    folder = locate()
    record = {"digest": folder_digest(folder), "source": source_name(path, subfolder), "files": folder_files(folder)}
    if not Path(path).exists():  # a hub snapshot: <cache>/models--org--name/snapshots/<revision>[/<subfolder>]
        record["revision"] = (folder.parent if subfolder else folder).name
    return record


def local_folder(spec, name: str) -> Path:
    """The folder holding a component's files: local as given, or the hub snapshot (downloaded if needed)."""
    path, subfolder = spec.source(name)
    local = Path(path)
    if local.exists():
        return local / subfolder if subfolder else local
    return _snapshot(path, subfolder, lambda err: spec.load_error(name, path, err))


def _snapshot(path: str, subfolder: str | None, error) -> Path:
    """A hub id's snapshot folder (downloaded if needed); `error(err)` is raised when it cannot be had."""
    local = Path(path)
    if local.exists():
        return local / subfolder if subfolder else local
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(path, allow_patterns=[f"{subfolder}/*"] if subfolder else None))
    except (OSError, ValueError) as err:
        if error is None:
            from vt.shared.errors import UserError

            raise UserError(
                f"caption_model: {path!r} is neither a folder nor a hub id that can be had ({err})"
            ) from err
        raise error(err) from err
    return folder / subfolder if subfolder else folder


def source_name(path: str, subfolder: str | None) -> str:
    """A component's source as the config names it: "<folder or hub id>[/<subfolder>]"."""
    return f"{path.rstrip('/')}/{subfolder}" if subfolder else path


def folder_files(folder: Path) -> dict[str, int]:
    """relative name -> size of every file under `folder` that its digest covers (a stat each, no read)."""
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in _digested_files(folder)}


def _digested_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def folder_digest(folder: Path) -> str:
    """sha256 over every file under `folder` (relative name, size, content or sampled content)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of model files; check model.path / model.components")
    digest = hashlib.sha256()
    for path in _digested_files(folder):
        digest.update(f"{path.relative_to(folder).as_posix()}\0{path.stat().st_size}\0".encode())
        digest.update(cached_file_digest(path).encode())
    return digest.hexdigest()[:16]


def digest_cache_path() -> Path:
    """Where file digests are kept between runs: $VT_CACHE_DIR or ~/.cache/vt, file_digests.json."""
    return Path(os.environ.get("VT_CACHE_DIR") or Path.home() / ".cache" / "vt") / "file_digests.json"


def cached_file_digest(path: Path) -> str:
    """file_digest, remembered by (absolute path, size, mtime, inode): both stages hash the same encoder
    weights at every start, and a file that kept its size and modification time is taken as unchanged.
    Files under CACHE_MIN_BYTES are hashed each time (faster than the cache). A cache that cannot be
    read or written is ignored."""
    stat = path.stat()
    if stat.st_size < CACHE_MIN_BYTES:
        return file_digest(path)
    cache_file = digest_cache_path()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache, dict) and isinstance(cache.get(key), str):
        return cache[key]
    digest = file_digest(path)
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = digest
    try:  # atomically: two processes starting at once each write a whole file, the later one wins
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return digest


def file_digest(path: Path) -> str:
    """sha256 of a whole small file, or of size + head + evenly spaced blocks of a big one."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(2**20), b""):
                digest.update(block)
            return digest.hexdigest()
        head = HEAD_BYTES
        if path.suffix == ".safetensors":  # the whole header: every tensor's name, dtype, shape, offsets
            (header_len,) = struct.unpack("<Q", f.read(8))
            head = max(head, 8 + header_len)
            f.seek(0)
        digest.update(f"sampled {size}\0".encode())
        digest.update(f.read(head))
        stride = (size - head) // SAMPLE_COUNT
        for i in range(SAMPLE_COUNT):
            f.seek(head + i * stride)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def describe_difference(expected: dict, found: dict) -> str:
    """ "key.path: shard has X, config wants Y; ..." for every setting that differs (nested keys dotted)."""
    diffs = [f"{key}: shard has {theirs!r}, config wants {ours!r}" for key, ours, theirs in _diff(expected, found, "")]
    return "; ".join(diffs) or "fingerprints differ but the recorded settings match (format change?)"


def _diff(expected, found, prefix: str):
    if isinstance(expected, dict) and isinstance(found, dict):
        for key in sorted(set(expected) | set(found)):
            yield from _diff(expected.get(key), found.get(key), f"{prefix}{key}.")
    elif _same_chain(expected, found):  # step by step: "processing.processors[1:crop].mode: ..."
        for index, (ours, theirs) in enumerate(zip(expected, found)):
            yield from _diff(ours, theirs, f"{prefix.rstrip('.')}[{index}:{ours['name']}].")
    elif expected != found:
        yield prefix.rstrip("."), expected, found


def _same_chain(expected, found) -> bool:
    """Two processor lists with the same steps in the same order (their options may differ)."""
    return (
        isinstance(expected, list)
        and isinstance(found, list)
        and len(expected) == len(found)
        and all(
            isinstance(a, dict) and isinstance(b, dict) and "name" in a and a.get("name") == b.get("name")
            for a, b in zip(expected, found)
        )
    )
