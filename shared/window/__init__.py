"""The rolling shard window: the one contract between vt-precompute (producers) and vt-train.

By role, each module holding one part of the protocol (docs/window.md explains it whole):

    layout.py    where every file lives (paths, seqs) and the window's errors
    ledger.py    the small shared records both sides read: registrations, consumer.json, commit records
    writer.py    the producer: lease, registration, backpressure, the two-step commit, progress
    reader.py    the trainer: the fixed order, checked shard reads, the consumer's positions
    cleaning.py  eviction below the watermark, orphan data, killed writers' temp files, by owning role
    state.py     the whole window at a glance (`vt-precompute inspect`)

Why it is safe at every crash point:
- A reader trusts only commit records; data without one is invisible. Records are created
  exclusively and name their data file, whose name carries the writer's lease generation and
  sha256, so two writers of one seq never overwrite or delete each other's bytes, and any other
  data file of a committed seq is an orphan that may be deleted at any time.
- Eviction deletes the records first, then the data: a crash in between leaves orphan data below
  the watermark, never a record without data. Everything below the watermark is known to be
  committed, so the bookkeeping (`next_seq`, the order) needs no record for it.
- A writer killed mid-write leaves only a temp file (or an uncompleted S3 upload) that no reader
  lists; the role that owns the folder removes it (cleaning.py), and `inspect` shows it meanwhile.

Callers take the role they need: `open_writer` (a producer), `open_reader` (the trainer, or any reader of the
order and shards), `inspect` (the whole window at a glance). Each is cheap to make and holds no lock.
"""

from __future__ import annotations

from vt.shared.errors import UserError

from ..lease import ProducerFenced
from ..storage import Storage
from .layout import (
    CONSUMER,
    ProducerConflict,
    ShardCorruptError,
    WindowTimeout,
    commit_path,
    data_path,
    empty_caption_path,
    eval_window_uri,
    producer_path,
    seq_of,
    validation_key,
    validation_path,
)
from .reader import Reader
from .state import window_state
from .writer import Writer

__all__ = [
    "CONSUMER",
    "ProducerConflict",
    "ProducerFenced",
    "Reader",
    "ShardCorruptError",
    "WindowTimeout",
    "Writer",
    "commit_path",
    "data_path",
    "empty_caption_path",
    "eval_window_uri",
    "inspect",
    "open_reader",
    "open_writer",
    "producer_path",
    "seq_of",
    "validation_key",
    "validation_path",
]


def _checked(size: int | str, poll_seconds: float, timeout_seconds: float) -> None:
    if size != "keep" and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise UserError(f'window.size must be a positive integer or "keep", got {size!r}')
    if poll_seconds <= 0 or timeout_seconds <= 0:
        raise UserError("window.poll_seconds and window.timeout_seconds must be positive")


def open_writer(
    uri: str,
    size: int | str = 8,
    poll_seconds: float = 0.2,
    timeout_seconds: float = 1800.0,
    storage: Storage | None = None,
) -> Writer:
    """The producer's side of the window at `uri` (writer.py): lanes, lease, registration, backpressure against
    `size` ("keep": never evicted, never waits), the two-step commit, progress, the conditions stored once."""
    _checked(size, poll_seconds, timeout_seconds)
    return Writer(storage or Storage(uri), size, poll_seconds, timeout_seconds)


def open_reader(
    uri: str,
    size: int | str = "keep",
    poll_seconds: float = 0.2,
    timeout_seconds: float = 1800.0,
    storage: Storage | None = None,
) -> Reader:
    """The consumer's side of the window at `uri` (reader.py): the fixed order, checked shard reads, the consumer's
    positions and eviction below the watermark (none with size="keep", the default for a reader that only reads)."""
    _checked(size, poll_seconds, timeout_seconds)
    return Reader(storage or Storage(uri), poll_seconds, timeout_seconds, keep=size == "keep")


def inspect(uri: str, storage: Storage | None = None) -> dict:
    """The window at a glance (state.py: producers, shards, positions, bytes, leftovers); reads every record."""
    return window_state(storage or Storage(uri))
