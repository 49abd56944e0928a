"""Stage 1: raw webdataset shards -> decode workers -> per-bucket buffers -> encode -> shard window.

Decoding (PyAV, CPU) runs in worker processes ahead of the encoder process, bounded so a long stream
never piles up in memory. Samples of one bucket are buffered until a shard is full, then encoded in
batches (captions through a per-run cache) and committed into the window, which blocks while the
trainer is behind. A bad sample is skipped and counted by reason; too many failures in a row stop the
run, since that means the input or the settings are wrong rather than a few clips.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from vt.precompute.processors import PreparedSample, prepare_sample
from vt.precompute.processors.errors import SampleError
from vt.precompute.report import Report
from vt.precompute.sources import RawSample, iter_raw_samples, list_raw_shards, split_for_rank
from vt.precompute.text_cache import TextCache
from vt.shared.buckets import Bucket, parse_buckets
from vt.shared.config import Config
from vt.shared.log import get_logger
from vt.shared.models import build_spec
from vt.shared.provenance import fingerprint, provenance
from vt.shared.shards import CommitRecord, encode_shard
from vt.shared.window import Window

log = get_logger("vt.precompute")

STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TooManyFailures(RuntimeError):
    pass


@dataclass
class Outcome:
    raw_key: str
    sample: PreparedSample | None
    reason: str | None
    detail: str
    seconds: float


def prepare_timed(raw: RawSample, buckets: list[Bucket], fps: float) -> Outcome:
    """Runs in a decode worker: a sample in, a prepared sample or the reason it was rejected out."""
    start = time.perf_counter()
    try:
        return Outcome(raw.key, prepare_sample(raw, buckets, fps), None, "", time.perf_counter() - start)
    except SampleError as err:
        return Outcome(raw.key, None, err.reason, err.detail, time.perf_counter() - start)
    except Exception as err:  # an unforeseen decoder failure is still one bad clip, not a dead run
        return Outcome(raw.key, None, "decode_error", repr(err), time.perf_counter() - start)


def bounded_map(fn: Callable, items: Iterable, pool, inflight: int) -> Iterator:
    """Ordered map over a process pool with at most `inflight` items submitted (no eager read-ahead)."""
    if pool is None:
        yield from map(fn, items)
        return
    queue: deque = deque()
    for item in items:
        queue.append(pool.apply_async(fn, (item,)))
        if len(queue) >= inflight:
            yield queue.popleft().get()
    while queue:
        yield queue.popleft().get()


class _Prepare:
    """Picklable `prepare_timed` bound to the bucket table (sent to workers once per task)."""

    def __init__(self, buckets: list[Bucket], fps: float):
        self.buckets, self.fps = buckets, fps

    def __call__(self, raw: RawSample) -> Outcome:
        return prepare_timed(raw, self.buckets, self.fps)


class Precompute:
    def __init__(self, config: Config, rank: int = 0, world_size: int = 1):
        self.config = config
        self.rank, self.world_size = rank, world_size
        pre = config.precompute
        self.buckets = parse_buckets(config.buckets.sizes)
        self.spec = build_spec(config.model)
        for bucket in self.buckets:
            self.spec.check_bucket(bucket)
        self.raw_shards = split_for_rank(list_raw_shards(config.data.raw), rank, world_size)
        self.device = torch.device("cuda" if pre.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if pre.device == "auto" else pre.device))
        self.storage_dtype = STORAGE_DTYPES[pre.storage_dtype]
        self.provenance = provenance(config)
        self.fingerprint = fingerprint(self.provenance)
        self.window = Window(config.window.uri, config.window.size, config.window.poll_seconds,
                             config.window.timeout_seconds)
        self.report = Report(rank=rank)
        self.seq = 0

    def _load_encoders(self) -> None:
        self.tokenizer = self.spec.load_tokenizer()
        self.text_encoder = self.spec.load_text_encoder(device=str(self.device)).eval()
        self.vae = self.spec.load_vae(device=str(self.device)).eval()
        self.text_cache = TextCache(lambda captions: self.spec.encode_conditions(self.tokenizer, self.text_encoder, captions))

    def run(self) -> Report:
        pre = self.config.precompute
        self.window.register_producer(self.rank, self.world_size)
        orphans = self.window.clean_orphans(self.rank)
        if orphans:
            log.info("removed %d uncommitted shard files left by an earlier run", len(orphans))
        done = self._committed_keys()
        self.seq = self.window.next_seq(self.rank)
        context = multiprocessing.get_context("spawn")
        pool = context.Pool(pre.workers) if pre.workers > 0 else None
        try:
            self._load_encoders()  # while the workers start
            with torch.inference_mode():
                passes = 1 if self.config.window.size == "keep" else self.config.train.epochs
                for epoch in range(passes):
                    self._run_epoch(epoch, pool, done)
        finally:
            if pool is not None:
                pool.terminate()
        self.window.finish_producer(self.rank, self.seq)
        self._write_report()
        return self.report

    def _committed_keys(self) -> set[tuple[int, str]]:
        """(epoch, key) of every sample this producer already committed (a restart skips them)."""
        done = set()
        for seq in range(self.window.next_seq(self.rank)):
            record = self.window.record(self.rank, seq)
            if record is not None:  # evicted ones are below the watermark: the trainer has them
                done.update((record.epoch, key) for key in record.keys)
        return done

    def _raw_samples(self, epoch: int, done: set) -> Iterator[RawSample]:
        for shard in self.raw_shards:
            started = time.perf_counter()
            for raw in iter_raw_samples(shard):
                self.report.seconds["read"] += time.perf_counter() - started
                if (epoch, raw.key) in done:
                    self.report.skipped_committed += 1
                else:
                    yield raw
                started = time.perf_counter()

    def _run_epoch(self, epoch: int, pool, done: set) -> None:
        pre = self.config.precompute
        pending: dict[Bucket, list[PreparedSample]] = {}
        failures_in_a_row = 0
        prepare = _Prepare(self.buckets, self.config.buckets.fps)
        inflight = max(2, 2 * pre.workers)
        from vt.train.progress import Progress

        progress = Progress(None, f"precompute[{self.rank}]", enabled=self.config.log.progress, unit="clip")
        for outcome in bounded_map(prepare, self._raw_samples(epoch, done), pool, inflight):
            self.report.seen += 1
            self.report.seconds["decode"] += outcome.seconds
            if outcome.sample is None:
                self.report.reject(outcome.reason)
                log.debug("skipped %s: %s %s", outcome.raw_key, outcome.reason, outcome.detail)
                failures_in_a_row += 1
                if failures_in_a_row >= pre.max_consecutive_failures:
                    self._write_report()
                    raise TooManyFailures(
                        f"{failures_in_a_row} samples in a row failed (last: {outcome.raw_key}: {outcome.reason} "
                        f"{outcome.detail}). Check data.raw and the bucket table; counts are in the report.")
                continue
            failures_in_a_row = 0
            bucket_samples = pending.setdefault(outcome.sample.bucket, [])
            bucket_samples.append(outcome.sample)
            if len(bucket_samples) >= pre.samples_per_shard:
                self._write_shard(pending.pop(outcome.sample.bucket), epoch)
            progress.update(1, shards=self.report.shards)
        for bucket in sorted(pending):  # the epoch's remainders: smaller shards, every sample kept
            self._write_shard(pending[bucket], epoch)
        progress.close()

    def _write_shard(self, samples: list[PreparedSample], epoch: int) -> CommitRecord:
        pre = self.config.precompute
        bucket = samples[0].bucket
        started = time.perf_counter()
        conditions = self.text_cache.encode([s.caption for s in samples])
        self.report.seconds["text_encode"] += time.perf_counter() - started
        started = time.perf_counter()
        latents: dict[str, list[torch.Tensor]] = {}
        for i in range(0, len(samples), pre.encode_batch):
            video = torch.stack([s.video for s in samples[i:i + pre.encode_batch]]).to(self.device)
            for name, tensor in self.spec.encode_latents(self.vae, video).items():
                latents.setdefault(name, []).append(tensor.cpu())
        self.report.seconds["vae_encode"] += time.perf_counter() - started
        tensors = {**conditions, **{name: torch.cat(parts) for name, parts in latents.items()}}
        tensors = {k: v.to(self.storage_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        keys = [s.key for s in samples]
        data = encode_shard(tensors, keys, {"provenance": self.provenance, "bucket": bucket.name, "epoch": epoch})
        started = time.perf_counter()
        self.window.wait_for_room(self.rank)
        self.report.seconds["wait"] += time.perf_counter() - started
        started = time.perf_counter()
        record = self.window.commit(self.rank, self.seq, epoch, data, bucket.name, keys, self.fingerprint)
        self.report.seconds["write"] += time.perf_counter() - started
        self.seq += 1
        self.report.shards += 1
        self.report.committed += len(samples)
        self.report.bytes += len(data)
        return record

    def _write_report(self) -> None:
        name = "precompute_report.json" if self.world_size == 1 else f"precompute_report.rank{self.rank}.json"
        self.report.write(self.config.run_dir / name)
        log.info(self.report.summary_line())
