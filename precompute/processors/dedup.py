"""The `dedup` processor: one copy of each clip kept, across producers, lanes and resumes, with no central index.

A clip's hash is a perceptual (DCT) hash of `frames` frames spread evenly over it (over the sample's own frames
once `sample_frames` has chosen them, so the windows of one clip differ): each frame scaled to 32x32 gray, its
2-D DCT, and one bit per coefficient of the 8x8 lowest frequencies, set where it is above their median (64 bits
a frame). Two clips are near-duplicates when their hashes differ in at most `max_distance` bits: re-encoding,
rescaling or a small colour change flip a few bits (the demo's carphone_distorted, a re-compressed
carphone_pristine, is 16 of 256 bits away); unrelated clips differ in about half.

The table is the window's storage, split into bands (multi-index hashing): the hash is cut into 16 bands, and a
clip claims `dedup/<band>-<bits>.json` for each, created exclusively (`create_exclusive`: an atomic link on a
local disk, a conditional PUT on S3) with its key and whole hash, or reads the claim another clip made first. Two
hashes within 15 bits always share a band (pigeonhole), further apart mostly still do. A clip meets each earlier
clip that shares one of its bands; of two near-duplicates the keeper is the owner of the first band they share
that either of them owns, a fact in storage that both (and any resumed or restarted producer, or one that takes
over the lane) read alike, so exactly one is kept and the choice never changes once made. The other is rejected
as `near_duplicate`, naming the keeper. A clip near a rejected one is rejected too (its claims stay). As the
owners of a clip's bands never change once it has claimed them, neither does its keeper: the choice is recorded in
`dedup/decided/<id>.json` (and remembered by the process), so the same sample met again (another epoch, a restart,
the lane's next holder) costs one read, not 16 creates and their reads. The table lives as long as the window; it
needs storage that every decode process shares (a path or s3://, not memory://).
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from vt.shared.chain import DedupOptions
from vt.shared.errors import UserError
from vt.shared.storage import Storage

from .errors import SampleError
from .filters import _LUMA
from .sample import Processor, Sample

_SIDE, _LOW = 32, 8  # frames are hashed at 32x32; the 8x8 lowest frequencies make the bits
_BANDS = 16  # the hash is claimed as this many bands
_STORES: dict[str, Storage] = {}  # one Storage per window URI in each process (a processor must pickle)
# storage -> {(key, hash, max_distance): its keeper} decided through it: a clip's band owners never change once it
# claimed its bands, so the next epoch's sample of the same frames costs no request (another Storage, as a
# restarted process has, reads the claims again)
_DECIDED: weakref.WeakKeyDictionary[Storage, dict[tuple[str, str, int], str]] = weakref.WeakKeyDictionary()


def _dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix: row k is frequency k."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    x = torch.arange(n, dtype=torch.float64)[None, :]
    m = torch.cos(math.pi * (2 * x + 1) * k / (2 * n)) * math.sqrt(2 / n)
    m[0] /= math.sqrt(2)
    return m


_DCT = _dct_matrix(_SIDE)


def frame_hash(rgb: torch.Tensor) -> int:
    """(H, W, 3) uint8 RGB at 32x32 -> its 64-bit perceptual hash."""
    gray = torch.einsum("hwc,c->hw", rgb.double(), _LUMA.double())
    low = (_DCT @ gray @ _DCT.T)[:_LOW, :_LOW].flatten()
    bits = (low > low.median()).tolist()
    return sum(1 << i for i, bit in enumerate(bits) if bit)


def clip_hash(sample: Sample, frames: int) -> str:
    """The hex perceptual hash of `frames` frames spread over the sample (its chosen frames, else its clip)."""
    if sample.bucket is None:
        start, end = 0.0, sample.info.duration
    else:
        start, end = sample.start, sample.start + sample.bucket.frames / sample.fps
    times = [start + (end - start) * (i + 0.5) / frames for i in range(frames)]
    decoded = torch.from_numpy(sample.clip.frames_at(times, size=(_SIDE, _SIDE)))
    return "".join(f"{frame_hash(frame):016x}" for frame in decoded)


def _storage(uri: str) -> Storage:
    if not uri:
        raise UserError(
            "the dedup processor keeps its table in the window's storage; run it through `vt-precompute run` "
            "(a chain built without a window has none)"
        )
    if uri not in _STORES:
        _STORES[uri] = Storage(uri)
    return _STORES[uri]


def bands(digest: str) -> list[str]:
    """The hex hash cut into _BANDS equal pieces (its length is a multiple of 16 hex digits)."""
    width = len(digest) // _BANDS
    return [digest[i * width : (i + 1) * width] for i in range(_BANDS)]


def distance(a: str, b: str) -> int:
    """Bits that differ between two hex hashes of one length."""
    return (int(a, 16) ^ int(b, 16)).bit_count()


def _claim(storage: Storage, index: int, bits: str, key: str, record: bytes) -> dict:
    """Band `index`'s claim: ours if this call created it, else the one the clip that came first made."""
    rel = f"dedup/{index:02d}-{bits}.json"
    return {"key": key} if storage.create_exclusive(rel, record) else json.loads(storage.read(rel))


def keeper(storage: Storage, digest: str, key: str, max_distance: int) -> str:
    """The key that keeps the clip of hash `digest` sampled as `key`: `key` itself, or the earlier near-duplicate
    that owns the first band the two share (see the module docstring). The bands are claimed at once (each
    claim is independent of the others): one round trip's wait instead of _BANDS on object storage."""
    decided, memo = _DECIDED.setdefault(storage, {}), (key, digest, max_distance)
    if memo not in decided:
        decided[memo] = _recorded(storage, key, digest, max_distance)
    return decided[memo]


def decision_path(key: str, digest: str, max_distance: int) -> str:
    """Where the choice for `key` at hash `digest` is kept once made (a name, whatever the key's characters)."""
    name = hashlib.sha256(f"{key}\0{digest}\0{max_distance}".encode()).hexdigest()[:32]
    return f"dedup/decided/{name}.json"


def _recorded(storage: Storage, key: str, digest: str, max_distance: int) -> str:
    """The keeper as recorded by the first process to decide it (a restart, another epoch's producer, a lane's next
    holder: one read instead of _BANDS creates and reads), else decided from the bands and recorded."""
    rel = decision_path(key, digest, max_distance)
    try:
        seen = json.loads(storage.read(rel))
    except FileNotFoundError:
        seen = None
    if seen is not None and (seen["key"], seen["hash"]) == (key, digest):
        return seen["keeper"]
    mine = bands(digest)
    record = json.dumps({"key": key, "hash": digest}).encode()
    with ThreadPoolExecutor(len(mine), thread_name_prefix="vt-dedup") as pool:  # per call: safe across forks
        owners = list(pool.map(lambda item: _claim(storage, *item, key, record), enumerate(mine)))
    chosen = _decide(owners, mine, digest, key, max_distance)
    # every process deciding it reads the same band owners, so any two records of it agree
    storage.create_exclusive(rel, json.dumps({"key": key, "hash": digest, "keeper": chosen}).encode())
    return chosen


def _decide(owners: list[dict], mine: list[str], digest: str, key: str, max_distance: int) -> str:
    met = {o["key"]: o["hash"] for o in owners if o["key"] != key}
    for other in sorted(met):
        if distance(digest, met[other]) > max_distance:
            continue
        shared = [i for i, (a, b) in enumerate(zip(mine, bands(met[other]))) if a == b]
        first = next(i for i in shared if owners[i]["key"] in (key, other))
        if owners[first]["key"] == other:
            return other
    return key


class Dedup(Processor):
    Options = DedupOptions

    def __call__(self, sample: Sample):
        digest = clip_hash(sample, self.options.frames)
        owner = keeper(_storage(sample.window), digest, sample.key, self.options.max_distance)
        if owner != sample.key:
            raise SampleError(
                "near_duplicate",
                f"within {self.options.max_distance} bits of the perceptual hash of {owner!r} (its own: {digest})",
            )
        yield sample
