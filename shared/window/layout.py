"""Where each file of a window lives, and the window's errors: names only, no storage access.

data/p<rank>/<seq:08d>-g<gen>-<sha16>.safetensors  shard data, written first (atomically)
commits/p<rank>/<seq:08d>.json       commit record, created exclusively once the data is complete
lanes.json                           {"lanes": L}: the number of lanes (producer ranks), fixed by the first producer
producers/p<rank>.json               {"rank", "world_size", "size", "done", "num_shards", "fingerprint"}
done/p<rank>                         written with the done flag: one listing tells the finished lanes
leases/p<rank>/<gen:08d>.json        one per producer start; the newest owns the rank (lease.py)
progress/p<rank>/<gen:08d>.json      the producer's resume state, written before each commit
consumer.json                        {"read": {rank: seq}, "watermark": {rank: seq}, + positions}
workers/<name>.json                  each producer's record: its lanes, status and counts (precompute/lanes.py)
text/validation-<fingerprint>/<key>.safetensors  a validation input's conditions as the family
                                     pipeline takes them: the trainer loads no text encoder
text/empty-<fingerprint>.safetensors the empty caption's text conditions, once per window
dedup/<band>-<bits>.json             the dedup processor's hash table: the first clip to claim a band of its
                                     perceptual hash, created exclusively (precompute/processors/dedup.py)
dedup/decided/<id>.json              a clip's keeper once its bands are claimed: {"key", "hash", "keeper"}
"""

from __future__ import annotations

import hashlib
import re

from vt.shared.errors import UserError

CONSUMER = "consumer.json"
LANES = "lanes.json"
WORKERS = "workers"
_SEQ = re.compile(r"(\d+)")


class WindowTimeout(UserError, TimeoutError):
    """A producer or reader waited longer than window.timeout_seconds for the other side."""


class ShardCorruptError(UserError):
    """A committed shard's data does not match its commit record (size or sha256)."""


class ProducerConflict(UserError, RuntimeError):
    """A commit record for this seq already exists with other content: two producers of one rank."""


EVAL_PREFIX = "eval"  # data.eval's window: under the training window's URI, never in its order


def eval_window_uri(uri: str) -> str:
    """Where vt-precompute writes `data.eval` (held-out samples) and the trainer reads them: the window's eval/."""
    return f"{uri.rstrip('/')}/{EVAL_PREFIX}"


def data_path(rank: int, seq: int, sha256: str, generation: int = 0) -> str:
    """Named by seq, writer generation and content: two writers never share a name, so neither can
    overwrite or delete the other's bytes."""
    return f"data/p{rank}/{seq:08d}-g{generation}-{sha256[:16]}.safetensors"


def worker_path(name: str) -> str:
    return f"{WORKERS}/{name}.json"


def commit_path(rank: int, seq: int) -> str:
    return f"commits/p{rank}/{seq:08d}.json"


def producer_path(rank: int) -> str:
    return f"producers/p{rank}.json"


def done_path(rank: int) -> str:
    """An empty marker beside the registration's done flag: one listing of done/ tells every finished lane."""
    return f"done/p{rank}"


def empty_caption_path(fingerprint: str) -> str:
    return f"text/empty-{fingerprint}.safetensors"


def validation_path(fingerprint: str, key: str) -> str:
    """A validation prompt's (or i2v image's) encoded conditions for shards of `fingerprint`; `key` names
    the content (`validation_key`)."""
    return f"text/validation-{fingerprint}/{key}.safetensors"


def validation_key(kind: str, content: bytes) -> str:
    """ "prompt-<sha256 of the text>" or "image-<sha256 of the file>", shortened: the same input, the same key."""
    return f"{kind}-{hashlib.sha256(content).hexdigest()[:16]}"


def seq_of(rel: str) -> int:
    """The seq in a data or record path ("data/p0/00000003-ab...safetensors" -> 3)."""
    return int(_SEQ.match(rel.rsplit("/", 1)[-1]).group(1))


def rank_of(rel: str) -> int:
    """The producer rank in a per-rank path ("commits/p1/00000003.json" -> 1)."""
    return int(rel.split("/")[1][1:])


def seqs(paths: list[str]) -> set[int]:
    return {seq_of(p) for p in paths}
