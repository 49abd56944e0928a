"""Stage 1: raw webdataset shards -> decode workers -> per-bucket buffers -> encode -> shard window.

Decoding (PyAV, CPU) runs in worker processes ahead of the encoder process, bounded so a long stream never piles
up in memory. Samples of one bucket are buffered until a shard is full, then encoded in batches (captions through a
per-run cache) and committed into the window, which blocks while the trainer is behind. With an offloaded text
encoder, `precompute.text_phase_shards` full shards wait (uncommitted: a crash decodes them again) for one text
phase to encode all their new captions, then are committed in the order they filled. A bad sample is skipped and
counted by reason; too many failures in a row stop the run, since that means the input or the settings are wrong
rather than a few clips. What is bad data is the error policy's call (processors/policy.py, passed to the chain in
the workers): any other exception in a processor is a bug, which stops the run at once as ProcessorBug (its
traceback logged, the buffered samples never written, so the window holds whole shards only).

Many producers: the window's raw shards are dealt to a fixed number of lanes (lane l: every L-th raw
shard from the l-th), each lane writing its own sequence into the one window. Any number of producers,
from any launcher, claim lanes through the window's storage (precompute/lanes.py): each works the lanes
it holds a commit at a time, and takes one more while all of them wait for the trainer.
Crash-safe: taking a lane removes its orphans and resumes from its progress record
(precompute/resume.py): raw shards already handled are skipped, the partial ones re-read without their
committed samples. So a producer killed at any point, its lane taken by another or by itself started
again, commits every accepted sample exactly once.

Samples are keyed by raw shard and key (`RawSample.sample_id`, see sources.py), named from the
whole raw shard list before the per-lane split. The processor chain (`precompute.processors`, run in
the decode workers) may make several samples of one raw sample, keyed `<sample_id>#<suffix>`; each
is committed once on its own, and a restart drops the parts of a re-decoded clip already committed. Every rejected sample is listed with its reason in
the run folder's rejects.jsonl (precompute/rejects.py), each once across restarts.

A family that trains audio (model.audio): the decode workers also decode each sample's sound over its
frames' time span at the family's rate and channels (processors/sound.py; a clip without sound follows
data.missing_audio), and the shard stores `spec.sound.encode`'s `audio_latents` beside the latents, one
row per sample key as every tensor. Without model.audio no sound is read and shards are as before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vt.precompute.encoders import (
    encode_sounds,
    encode_texts_with_images,
    encode_videos,
    load_encoders,
    text_phase,
    tiled_buckets,
)
from vt.precompute.lanes import LaneHolder, producer_name, wanted_lanes
from vt.precompute.prepare import Prepare, ShardEnd
from vt.precompute.processors import PreparedSample, ProcessorBug, SoundRequest, bad_data_only, build_chain, worker_init
from vt.precompute.rejects import RejectLog, rejects_name
from vt.precompute.report import ProgressBar, Report
from vt.precompute.resume import Tracker, resume_state, shards_digest
from vt.precompute.sources import RawSample, iter_raw_samples, list_raw_shards, shard_names, split_for_rank
from vt.precompute.text_cache import TextCache
from vt.precompute.validation_conditions import write_validation_conditions
from vt.precompute.workers import DecodePool
from vt.shared.buckets import Bucket, parse_buckets
from vt.shared.caption_table import Captions, encode_caption
from vt.shared.chain import captioner_options
from vt.shared.config import Config
from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.shared.models import spec_for
from vt.shared.provenance import captioner_records, component_records, fingerprint, provenance
from vt.shared.runtime import DTYPES, encoder_dtype, map_large_allocations, pick_device
from vt.shared.shards import encode_shard
from vt.shared.startup import StartupTimeline
from vt.shared.window import ProducerFenced, eval_window_uri, open_writer

log = get_logger("vt.precompute")
_warned: set[str] = set()  # settings that do nothing, warned about once per process


class TooManyFailures(UserError, RuntimeError):
    pass


def decode_pool(pre):
    """The decode workers `precompute.engine` asks for: local processes, Ray actors, or None (decode in this one)."""
    if pre.engine == "ray":
        from vt.precompute.ray_pool import RayDecodePool

        return RayDecodePool(pre.ray_actors, worker_init, pre.ray_tries, pre.ray_timeout_seconds)
    return DecodePool(pre.workers, initializer=worker_init) if pre.workers > 0 else None


def sound_request(spec, config: Config) -> SoundRequest:
    """What the decode workers decode of each clip's sound: the family's rate and channels, data.missing_audio."""
    audio = spec.sound.format()
    return SoundRequest(audio.sample_rate, audio.channels, config.data.missing_audio)


def held_out_config(config: Config) -> Config:
    """The config `data.eval` is encoded with: its raw data into the window's eval/ prefix, kept (read by every
    evaluation), its reports in <run.dir>/eval/, and no validation inputs (the training window holds them)."""
    return config.model_copy(
        update={
            "data": config.data.model_copy(update={"raw": config.data.eval, "eval": None}),
            "window": config.window.model_copy(update={"uri": eval_window_uri(config.window.uri), "size": "keep"}),
            "run": config.run.model_copy(update={"dir": str(config.run_dir / "eval")}),
            "validation": config.validation.model_copy(
                update={"prompts": [], "images": [], "last_images": [], "videos": []}
            ),
        }
    )


def run_stage1(config: Config) -> Report:
    """`vt-precompute run`: lanes of `data.eval` (if set) into the window's eval/ prefix, then of `data.raw` into
    the window, with the encoders loaded once, until every lane is done; returns the training data's report."""
    encoders = None
    if config.data.eval:
        held_out = Precompute(held_out_config(config))
        held_out.run()
        encoders = held_out.encoders
    return Precompute(config, encoders=encoders).run()


BLOCKED, COMMITTED = "blocked", "committed"  # what a lane's steps yield: its window share is full, a shard is in


@dataclass
class LaneRun:
    """One held lane's work: its raw shards, where its stream stands, its next seq and lease generation."""

    index: int
    generation: int
    raw_shards: list[str]
    shards_id: str
    seq: int = 0
    rejects: RejectLog | None = None
    blocked_since: float | None = None  # waiting for room since (monotonic), else None
    fill: tuple[int, int] = (0, 0)  # (unread, share) at its latest look at the window's room

    def close(self) -> None:
        if self.rejects is not None:
            self.rejects.close()


class Precompute:
    def __init__(self, config: Config, encoders: dict | None = None):
        """`encoders`: stage 1's components already loaded (another Precompute's: run_stage1), else loaded here."""
        self.startup = StartupTimeline()
        self.startup.mark("imports")  # the interpreter and the CLI's imports, up to here
        map_large_allocations()  # decoded clips and encoder activations go back to the OS when freed
        self.config = config
        self.encoders = encoders
        self.name = producer_name()
        pre = config.precompute
        # The decode workers start first: a spawned worker spends seconds importing torch and PyAV, which then
        # overlaps this process's imports of the encoders' libraries and its model loads (closed by run()).
        self.pool = decode_pool(pre)
        if self.pool is not None:
            self.pool.warm_up()
        self.startup.mark("decode_workers_spawned")
        try:
            self._set_up(config)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the decode workers (run() does this when it ends)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _set_up(self, config: Config) -> None:
        pre = config.precompute
        self.buckets = parse_buckets(config.buckets.sizes)
        self.chain = build_chain(pre.processors, window=config.window.uri)
        self.spec = spec_for(config)
        for bucket in self.buckets:
            self.spec.check_bucket(bucket)
        self.startup.mark("model_spec")
        self.every_shard = list_raw_shards(config.data.raw)
        self.shard_names = shard_names(self.every_shard)  # from the whole list: every lane names shards alike
        # The member each sample's control video is read from, for a family that trains on one (else none).
        self.control = config.data.control if self.spec.control_video else None
        # Each sample's sound at the family's rate and channels, for a run that trains audio (else none is read).
        self.sound = sound_request(self.spec, config) if config.model.audio else None
        self.device = pick_device(pre.device)
        self.storage_dtype = DTYPES[pre.storage_dtype]
        # each encoder's digest, and where it came from (caption_model's vision-language model's too)
        components = {**component_records(self.spec), **captioner_records(config)}
        self.captioner = None  # caption_model's model, loaded with the encoders
        self.provenance = provenance(config, {name: c.pop("digest") for name, c in components.items()}, self.spec)
        self.fingerprint = fingerprint(self.provenance)
        self.sources = components  # beside the provenance in every shard: what a trainer checks unloaded encoders by
        self.startup.mark("raw_list_and_weight_digests")
        self.window = open_writer(
            config.window.uri, config.window.size, config.window.poll_seconds, config.window.timeout_seconds
        )
        self.lanes = self.window.lanes(wanted_lanes(pre.lanes), len(self.every_shard))
        self.report = Report(producer=self.name, startup=self.startup)
        self.progress: ProgressBar | None = None
        self.holder: LaneHolder | None = None
        self.phase_shards = pre.text_phase_shards if pre.text_encoder_offload != "none" else 1
        if pre.text_phase_shards > 1 and pre.text_encoder_offload == "none" and "phase_shards" not in _warned:
            _warned.add("phase_shards")
            log.warning(
                "precompute.text_phase_shards = %d does nothing with precompute.text_encoder_offload = "
                '"none" (the text encoders stay on the device): each shard is written as it fills',
                pre.text_phase_shards,
            )

    def _load_encoders(self) -> None:
        pre = self.config.precompute
        if self.encoders is None:
            self.encoders = load_encoders(self.spec, self.device, pre.text_encoder_offload, pre.vae_tiling)
        options = captioner_options(pre.processors)
        if options is not None and self.captioner is None:
            from vt.precompute.captioner import Captioner

            self.captioner = Captioner(options, self.device, encoder_dtype(self.device, self.spec.frozen_dtype))
        self.tiled = tiled_buckets(self.spec, self.encoders, self.buckets, self.device, pre.vae_tiling)
        # "model": a phase's captions a shard's worth per call (the encoder's working memory as with one shard);
        # "blocks" streams the encoder once per call, so a phase's new captions are one call.
        batch = pre.samples_per_shard if pre.text_encoder_offload == "model" else None
        self.text_cache = TextCache(self._encode_text, batch=batch)

    def _text_phase(self):
        """The text encoders on the device for the block (precompute/encoders.py; nested ones move nothing)."""
        return text_phase(self.encoders, self.spec, self.device, self.config.precompute.text_encoder_offload)

    def _encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """New captions, in a text phase (the caller's, or one of their own)."""
        with self._text_phase():
            return self.spec.encode_text(self.encoders, captions)

    def run(self) -> Report:
        """Work the window's lanes, each over every epoch, until all are done; resumes where earlier runs stopped."""
        try:
            self._run()
            if self.report.status == "running":
                self.report.status = "done"
        except BaseException as err:
            if isinstance(err, ProcessorBug):  # its own traceback, formatted where it ran (maybe a worker)
                log.error("%s", err.traceback.rstrip())
            self.report.status = f"failed: {type(err).__name__}: {err}"
            raise
        finally:
            if self.holder is not None:
                self.holder.close()  # releases the lanes still held, on an error too
            self.close()
            self._write_report()
        return self.report

    def _status(self) -> dict:
        """This producer's counts for its workers/ record (`vt-precompute status`)."""
        d = self.report.to_dict()
        return {
            "worked": list(self.report.lanes),
            **{key: d[key] for key in ("status", "committed", "seen", "rejected", "samples_per_s", "elapsed_s")},
        }

    def _run(self) -> None:
        pre = self.config.precompute
        self.holder = LaneHolder(self.window.storage, self.lanes, pre.claim_seconds, self.name, self._status)
        if self.holder.all_done():
            log.info("every lane of %s is done already", self.window.uri)
            self.report.status = "already done"
            return
        self.startup.mark("window")
        self.progress = ProgressBar(self.report, enabled=self.config.log.progress)
        try:
            self._load_encoders()  # while the workers start
            self.startup.mark("encoders_loaded")
            with torch.inference_mode(), self._text_phase():  # the empty caption and the prompts: one phase
                self._write_empty_caption()
                write_validation_conditions(
                    self.spec, self.encoders, self.config, self.window, self.fingerprint, self.storage_dtype
                )
            with torch.inference_mode():
                self.startup.mark("empty_caption_and_validation_prompts")
                self._work()
        finally:
            self.report.decode_restarts = getattr(self.pool, "restarts", 0)
            self.progress.close()

    def _work(self) -> None:
        """Step every held lane in turn, a commit at a time; look for one more lane while all held ones wait for the
        trainer, or while none is held (backing off while looks find none); end once every lane is done."""
        held: dict[int, Iterator[str]] = {}
        runs: dict[int, LaneRun] = {}
        base = min(self.config.precompute.claim_seconds / 4, 2.0)
        longest = {
            True: self.config.precompute.claim_seconds * max(1.0, self.lanes / 1000),  # holding lanes
            False: base * max(1.0, self.lanes / 250),
        }  # holding none: how late it may exit after the last lane
        wait, next_look = base, 0.0
        while True:
            moved = False
            for index in list(held):
                try:
                    step = next(held[index])
                except (StopIteration, ProducerFenced) as err:
                    if isinstance(err, ProducerFenced):  # taken over while this producer was silent: the taker goes on
                        log.warning("%s", err)
                        self.holder.lost(index)
                    else:
                        self.holder.let_go(index)
                    del held[index]
                    runs.pop(index).close()
                    wait, next_look, moved = base, 0.0, True
                    continue
                moved |= step == COMMITTED
            if moved:
                continue
            now = time.monotonic()
            if now >= next_look:  # every held lane waits (or none is held): look for another
                taken = self.holder.take()
                if taken is not None:
                    run = self._lane(*taken)
                    runs[run.index], held[run.index] = run, self._lane_steps(run)
                    wait = base
                    continue
                if not held and self.holder.finished:
                    return
                # Back off while looks find nothing (docs/scale.md "Claims"); a producer with nothing to do learns from
                # its looks when every lane is done.
                wait, next_look = min(2 * wait, longest[bool(held)]), now + wait
            self._check_blocked(runs.values())
            started = time.perf_counter()
            time.sleep(self.config.window.poll_seconds)
            self.report.seconds["wait"] += time.perf_counter() - started

    def _check_blocked(self, runs) -> None:
        """Raise WindowTimeout once a lane has waited window.timeout_seconds for room (the trainer is gone)."""
        for run in runs:
            if run.blocked_since is not None and time.monotonic() - run.blocked_since > self.window.timeout_seconds:
                raise self.window.timeout(run.index, *run.fill)

    def _lane(self, index: int, generation: int) -> LaneRun:
        raw_shards = split_for_rank(self.every_shard, index, self.lanes)
        self.window.hold(index, generation)
        self.report.lanes.append(index)
        if self.report.generation is None:
            self.report.generation = generation
        return LaneRun(index, generation, raw_shards, shards_digest(raw_shards))

    def _lane_steps(self, run: LaneRun) -> Iterator[str]:
        """One lane over every epoch, from where its progress record says; yields BLOCKED while its share of the
        window is full and COMMITTED after each shard; ends at its done marker."""
        lane = run.index
        if not self.window.register_producer(lane, self.lanes, self.fingerprint):
            return
        self.window.clean_orphans(lane)
        state, run.seq = resume_state(self.window, lane, run.shards_id)
        if len(self.report.lanes) == 1:
            self.report.resumed_at = run.seq
        # An earlier run's list stays (its raw shards may not be read again) unless nothing it did is kept.
        rejects_path = self.config.run_dir / rejects_name(lane, self.lanes)
        run.rejects = RejectLog(rejects_path, keep=run.seq > 0 or not state.is_empty())
        self.report.rejects_file = str(rejects_path if self.lanes == 1 else self.config.run_dir / "rejects.lane*.jsonl")
        if run.seq:
            log.info(
                "lane %d resumes at shard %d (epoch %d, %d raw shards done)",
                lane,
                run.seq,
                state.epoch,
                len(state.complete),
            )
        tracker = Tracker(state)
        passes = 1 if self.config.window.size == "keep" else self.config.train.epochs
        for epoch in range(state.epoch, passes):
            tracker.start_epoch(epoch)
            yield from self._run_epoch(run, epoch, tracker)
        self.window.finish_producer(lane, run.seq)

    def _raw_items(self, run: LaneRun, tracker: Tracker) -> Iterator[tuple[int, RawSample] | ShardEnd]:
        """(raw index, sample) of the lane's raw shards, minus what is committed; ShardEnd after each."""
        for index, shard in enumerate(run.raw_shards):
            if index in tracker.state.complete:
                self.report.skipped_shards += 1
                continue
            started = time.perf_counter()
            for raw in iter_raw_samples(shard, self.shard_names[shard], self.control):
                self.report.seconds["read"] += time.perf_counter() - started
                # A sample with an error is never committed (a duplicate_key shares its key with one that may be).
                if raw.error is None and tracker.state.committed(index, raw.sample_id):
                    self.report.skipped_committed += 1
                else:
                    yield index, raw
                started = time.perf_counter()
            yield ShardEnd(index)

    def _run_epoch(self, run: LaneRun, epoch: int, tracker: Tracker) -> Iterator[str]:
        pre = self.config.precompute
        pending: dict[Bucket, list[tuple[int, PreparedSample]]] = {}
        full: list[list[tuple[int, PreparedSample]]] = []  # full shards waiting for their text phase
        failures_in_a_row = 0
        # Bad data is rejected and counted; a processor's bug stops the run (processors/policy.py).
        prepare = Prepare(self.chain, self.buckets, self.config.buckets.fps, bad_data_only, self.sound)
        # Enough queued that the workers keep decoding while a full shard is encoded (at most about
        # one shard more in memory than the bucket buffers hold).
        pool = self.pool
        workers = pool.workers if pool is not None else 0
        inflight = max(2, 2 * workers, workers + pre.samples_per_shard)
        items = self._raw_items(run, tracker)
        stream = map(prepare, items) if pool is None else pool.map(prepare, items, inflight, prepare.crashed)
        for item in stream:
            if isinstance(item, ShardEnd):
                tracker.end_of_shard(item.index)
                continue
            index, outcome = item
            self.startup.mark("first_decoded_sample")
            self.report.seen += 1
            self.report.seconds["decode"] += outcome.seconds
            for key, reason, detail in outcome.dropped:  # parts rejected alone (a scene, a window)
                self.report.reject(reason)
                run.rejects.add(epoch, outcome.shard, outcome.position, key, reason, detail)
            if outcome.samples is None:
                self.report.reject(outcome.reason)
                run.rejects.add(epoch, outcome.shard, outcome.position, outcome.key, outcome.reason, outcome.detail)
                log.debug("skipped %s: %s %s", outcome.key, outcome.reason, outcome.detail)
                failures_in_a_row += 1
                if failures_in_a_row >= pre.max_consecutive_failures:
                    raise TooManyFailures(
                        f"{failures_in_a_row} samples in a row failed (last: {outcome.key}: {outcome.reason} "
                        f"{outcome.detail}). Check data.raw and the bucket table; counts are in the report."
                    )
                self.progress.update()
                continue
            failures_in_a_row = 0
            for sample in outcome.samples:
                # A clip split into several samples is decoded again after a restart; its parts
                # already committed are dropped here (the raw sample as a whole was not).
                if sample.key != outcome.key and tracker.state.committed(index, sample.key):
                    self.report.skipped_committed += 1
                    continue
                tracker.accepted(index)
                bucket_samples = pending.setdefault(sample.bucket, [])
                bucket_samples.append((index, sample))
                if len(bucket_samples) >= pre.samples_per_shard:
                    full.append(pending.pop(sample.bucket))
                    if len(full) >= self.phase_shards:
                        yield from self._write_shards(run, full, epoch, tracker)
                        full = []
            self.progress.update()
        # the epoch's remainders: smaller shards, every sample kept
        yield from self._write_shards(run, full + [pending[bucket] for bucket in sorted(pending)], epoch, tracker)

    def _write_shards(
        self, run: LaneRun, shards: list[list[tuple[int, PreparedSample]]], epoch: int, tracker: Tracker
    ) -> Iterator[str]:
        """`shards` committed one by one in the order they filled, after one text phase for all of them (none if
        every caption is encoded already): their new captions into the text cache and, where the text encoder reads
        each caption with its clip's first frame, every sample's conditions."""
        if self.captioner is not None:  # caption_model: the model's captions first, in a phase of their own
            shards = self._caption(shards)
        samples = [sample for items in shards for _, sample in items]
        started = time.perf_counter()
        sample_text: dict[str, list[torch.Tensor]] = {}
        captions = [caption for s in samples for caption in s.captions]  # each sample's every caption
        if self.spec.text_with_image and len(captions) > len(samples):
            raise UserError(
                f"samples with several captions (caption_model's mode \"both\", caption's variant_fields), but the "
                f"{self.spec.family} text encoder reads each caption with its clip's first frame, "
                "one caption per sample: give each sample one caption"
            )
        if self.spec.text_with_image or self.text_cache.new(captions):
            with self._text_phase():
                self.text_cache.fill(captions)
                sample_text = self._encode_text_with_images(samples)
        self.report.seconds["text_encode"] += time.perf_counter() - started
        first = 0
        for items in shards:
            part = {name: rows[first : first + len(items)] for name, rows in sample_text.items()}
            first += len(items)
            yield from self._write_shard(run, items, epoch, tracker, part)

    def _caption(self, shards: list[list[tuple[int, PreparedSample]]]) -> list[list[tuple[int, PreparedSample]]]:
        """The shards' samples with caption_model's captions (precompute/captioner.py), those left without a caption
        dropped (counted), and the shards left empty with them."""
        from vt.precompute.captioner import caption_samples

        started = time.perf_counter()
        flat = [item for items in shards for item in items]
        made = caption_samples(self.captioner, [sample for _, sample in flat])
        self.report.seconds["caption"] += time.perf_counter() - started
        out, at = [], 0
        for items in shards:
            kept = [(index, sample) for (index, _), sample in zip(items, made[at : at + len(items)]) if sample]
            at += len(items)
            out += [kept] if kept else []
        for _ in range(len(flat) - sum(len(items) for items in out)):
            self.report.reject("empty_model_caption")
        return out

    def _stored(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Floating tensors in the storage dtype, others as they are."""
        return {k: v.to(self.storage_dtype) if v.is_floating_point() else v for k, v in tensors.items()}

    def _write_empty_caption(self) -> None:
        """The empty caption's conditions, once per window, for the trainer's caption dropout."""
        conditions = self._stored(self.text_cache.encode([""]))
        self.window.put_empty_caption(self.fingerprint, encode_caption(conditions, self.spec.text_masks))

    def _encode_text_with_images(self, samples: list[PreparedSample]) -> dict[str, list[torch.Tensor]]:
        """Per-sample text conditions (in the caller's text phase) where the family's text encoder reads each caption
        with its clip's first frame (`spec.text_with_image`: a Llava reading the frame inside the prompt); {}
        otherwise."""
        if not self.spec.text_with_image:
            return {}
        return encode_texts_with_images(
            self.spec, self.encoders, [s.caption for s in samples], [s.first_frame for s in samples], self.device
        )

    def _write_shard(
        self,
        run: LaneRun,
        items: list[tuple[int, PreparedSample]],
        epoch: int,
        tracker: Tracker,
        sample_text: dict[str, list[torch.Tensor]],
    ) -> Iterator[str]:
        """One shard encoded and committed, its text conditions made in _write_shards' text phase."""
        pre = self.config.precompute
        samples = [sample for _, sample in items]
        bucket = samples[0].bucket
        captions = Captions.of(  # every caption of a sample once; several: the trainer draws one per epoch
            [s.caption for s in samples], self.text_cache.encode, self.spec.text_masks, [s.captions for s in samples]
        )
        started = time.perf_counter()
        controls = [s.control for s in samples] if self.control else None  # aligned with the clips, frame for frame
        latents = encode_videos(
            self.spec,
            self.encoders,
            [s.video for s in samples],
            pre.encode_batch,
            self.device,
            bucket.name,
            bucket.name in self.tiled,
            controls,
        )
        if self.sound is not None:  # model.audio: `audio_latents`, one row per sample as the latents
            latents.update(
                encode_sounds(
                    self.spec, self.encoders, [s.sound for s in samples], bucket, pre.encode_batch, self.device
                )
            )
        self.report.seconds["vae_encode"] += time.perf_counter() - started
        tensors = self._stored({name: torch.cat(parts) for name, parts in {**latents, **sample_text}.items()})
        captions.conditions = self._stored(captions.conditions)
        keys = [s.key for s in samples]
        meta = {"provenance": self.provenance, "sources": self.sources, "bucket": bucket.name, "epoch": epoch}
        if self.captioner is not None or any(s.extra_captions for s in samples):  # each sample's captions as made
            meta["captions"] = {s.key: s.captions for s in samples}
        if any(s.clip for s in samples):  # a manifest's clips: where each came from, and its metadata
            meta["clips"] = {s.key: s.clip for s in samples if s.clip}
        data = encode_shard(tensors, keys, meta, captions)
        while True:  # the lane's share of the window full: the other lanes go on meanwhile (_work)
            unread, share = run.fill = self.window.room(run.index)
            if unread < share or self.config.window.size == "keep":
                break
            run.blocked_since = run.blocked_since or time.monotonic()
            yield BLOCKED
        run.blocked_since = None
        started = time.perf_counter()
        record = self.window.prepare(run.index, run.seq, epoch, data, bucket.name, keys, self.fingerprint)
        committed = [(index, sample.key) for index, sample in items]
        # Write-ahead: the progress record must name this shard before it can be read and evicted.
        self.window.write_progress(run.index, tracker.intent(run.seq, committed, run.shards_id, run.generation))
        self.window.publish(record, data)
        tracker.committed(committed)
        self.report.seconds["write"] += time.perf_counter() - started
        run.seq += 1
        self.report.shards += 1
        self.report.committed += len(samples)
        self.report.bytes += len(data)
        self.progress.window(unread + 1, share)
        yield COMMITTED

    def _write_report(self) -> None:
        alone = (
            self.lanes == 1
            and (self.report.lanes == [0] or self.report.status == "already done")
            and "SLURM_ARRAY_TASK_ID" not in os.environ
        )
        name = "precompute_report.json" if alone else f"precompute_report.{self.name}.json"
        self.report.write(self.config.run_dir / name)
        log.info(self.report.summary_line())
