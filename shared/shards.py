"""The latent shard format and its commit record.

A shard holds the samples of one bucket: each named tensor is stacked along dim 0, one row per
sample key, and the lot is one safetensors file (no pickle, so reading a shard runs no code). The
safetensors metadata (string -> string) carries the format version, the sample keys and a JSON
`meta` dict (bucket, provenance fingerprint, ...), so a shard describes itself without its record.
Text conditions are stored once per distinct caption, trimmed to the caption's rows, and samples
refer to them (shared/caption_table.py, version 2); `decode_shard` gives every sample its caption's
tensors padded back, so readers see one row per sample for every name as in version 1.

A commit record is the small JSON that makes a shard visible in the window: it names the data file
and pins its size and sha256, so a reader detects a file that changed after it was committed.

torch is imported inside the functions that need it: window bookkeeping (records, orders, eviction)
runs in processes that never touch a tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import MISSING, asdict, dataclass, fields
from typing import TYPE_CHECKING

from vt.shared.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

    from .caption_table import Captions

FORMAT_VERSION = 2  # 2: the caption table (text stored once per distinct caption, trimmed)


class ShardFormatError(UserError):
    """Bytes that are not a vt latent shard of this format version, or a malformed record."""


def encode_shard(
    tensors: dict[str, "Tensor"], keys: list[str], meta: dict, captions: "Captions | None" = None
) -> bytes:
    """Stacked tensors (dim 0 = sample, one row per key), plus the samples' text conditions once per
    distinct caption (`captions`), -> safetensors bytes."""
    import torch
    from safetensors.torch import save

    from .caption_table import is_text, pack
    from .shard_rows import digests_of

    if not keys or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"a shard needs a non-empty list of string sample keys, got {keys!r}")
    if len(set(keys)) != len(keys):
        raise ValueError("sample keys in one shard must be unique; a key repeats")
    if not tensors:
        raise ValueError("a shard needs at least one tensor")
    text, lengths = (
        pack(captions.conditions, captions.index, captions.masks, captions.choices) if captions else ({}, {})
    )
    if captions is not None and len(captions.index) != len(keys):
        raise ValueError(f"{len(captions.index)} caption references for {len(keys)} sample keys")
    for name, tensor in tensors.items():
        if is_text(name) or name in lengths:
            raise ValueError(f"shard tensor name {name!r} is taken by the caption table; rename it")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"shard tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dim() == 0 or tensor.shape[0] != len(keys):
            raise ValueError(
                f"shard tensor {name!r} has shape {tuple(tensor.shape)}; dim 0 must "
                f"be the {len(keys)} samples (one row per key), stack them first"
            )
    try:
        meta_json = json.dumps(meta, sort_keys=True)
    except TypeError as err:
        raise ValueError(f"shard meta must be JSON-serializable: {err}") from err
    metadata = {
        "format": "vt-latent-shard",
        "format_version": str(FORMAT_VERSION),
        "keys": json.dumps(keys),
        "meta": meta_json,
        "text_lengths": json.dumps(lengths, sort_keys=True),
    }
    stored = {n: t.detach().cpu().contiguous() for n, t in {**tensors, **text}.items()}
    # The row digests hash the tensors' bytes as stored, so the file is laid out once without them; the
    # metadata does not move any tensor's bytes within the data, only the header's length.
    metadata.update(digests_of(save(stored, metadata=metadata)))
    return save(stored, metadata=metadata)


def decode_shard(data: bytes) -> tuple[dict[str, "Tensor"], list[str], dict]:
    """safetensors bytes -> (tensors, keys, meta), every tensor one row per key (captions padded
    back); rejects other formats and versions."""
    from safetensors.torch import load

    from .caption_table import INDEX, is_text, per_sample

    metadata = read_shard_metadata(data)
    keys = json.loads(metadata["keys"])
    stored = load(bytes(data))
    tensors = {name: t for name, t in stored.items() if not is_text(name)}
    lengths = json.loads(metadata.get("text_lengths", "{}"))
    if lengths:
        try:
            if stored[INDEX].shape[0] != len(keys):
                raise ValueError(f"its index has {stored[INDEX].shape[0]} rows for {len(keys)} keys")
            tensors.update(per_sample(stored, lengths))
        except (KeyError, ValueError, IndexError) as err:
            raise ShardFormatError(f"shard caption table is malformed: {err}") from err
    for name, tensor in tensors.items():
        if tensor.shape[0] != len(keys):
            raise ShardFormatError(f"shard tensor {name!r} has {tensor.shape[0]} rows for {len(keys)} keys")
    return tensors, keys, json.loads(metadata["meta"])


def read_shard_metadata(data: bytes) -> dict[str, str]:
    """The safetensors `__metadata__` of a shard, checked for format and version (no tensors read)."""
    if len(data) < 8:
        raise ShardFormatError(f"{len(data)} bytes is too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ShardFormatError("safetensors header length exceeds the data: truncated or not a shard")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except ValueError as err:
        raise ShardFormatError(f"safetensors header is not JSON: {err}") from err
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != "vt-latent-shard":
        raise ShardFormatError(
            "safetensors file is not a vt latent shard (no vt metadata); "
            "write shards with vt.shared.shards.encode_shard"
        )
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise ShardFormatError(
            f"shard format version {metadata.get('format_version')} is not "
            f"{FORMAT_VERSION} (version 2 stores each caption's text once); re-run "
            "vt-precompute with this vt version into a fresh window"
        )
    return metadata


@dataclass
class CommitRecord:
    """What makes shard `seq` of producer `producer` visible; see docs/window.md, "Shards"."""

    producer: int
    seq: int
    epoch: int
    bucket: str
    keys: list[str]
    data: str  # path of the data file, relative to the window root
    nbytes: int
    sha256: str
    fingerprint: str
    # The header's size and sha256 (shard_rows.py): a reader of some rows checks the header against these and
    # each row against the header's digests. 0 and "" in records of shards without row digests (read whole).
    header_bytes: int = 0
    header_sha256: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "CommitRecord":
        try:
            obj = json.loads(data)
        except ValueError as err:
            raise ShardFormatError(f"commit record is not JSON: {err}") from err
        if not isinstance(obj, dict):
            raise ShardFormatError("commit record must be a JSON object")
        version = obj.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise ShardFormatError(
                f"commit record format version {version} is not {FORMAT_VERSION}; "
                "re-run vt-precompute with this vt version"
            )
        names = [f.name for f in fields(cls)]
        missing = [f.name for f in fields(cls) if f.name not in obj and f.default is MISSING]
        if missing:
            raise ShardFormatError(f"commit record lacks {', '.join(missing)}")
        return cls(**{n: obj[n] for n in names if n in obj})
