"""The training loop: window batches -> Model Spec forward -> flow matching loss -> AdamW.

One bucket per step, no padding. The same loop runs as one process or under torchrun: every rank
reads the same global batches and trains on its data-parallel slice (parallel/batching.py); the
model is wrapped by `parallelize` (pipeline stages, TP, CP, activation checkpointing, compile,
FSDP2/HSDP or DDP); with pipeline stages a rank's slice runs through torch.distributed.pipelining's
schedule one sample per microbatch (parallel/pp.py). Each option that changes the model, the step or memory is a
part (vt.train.parts): the trainer calls the parts' hooks and branches on none of them. Draws, the forward and the
loss are one path (train/step.py), which the held-out loss shares. Noise and sigmas come from (seed, step, sample
index), the data cursor and optimizer live in the DCP checkpoint, so a resumed run, at any world size with the same
global batch, repeats the uninterrupted run's losses. Rank 0 alone writes metrics, window consumer state, exports and
plots. A step reads one thing back to the host, whether its loss and gradient norm are finite (a non-finite one stops
the run before the optimizer applies it); the metrics stay device tensors until a step is logged (every rank decides
that alike, run_stats.StepLog).
"""

from __future__ import annotations

import json
import math
import time
from itertools import islice
from pathlib import Path

import torch

from vt.shared.buckets import parse_buckets
from vt.shared.caption_table import decode_caption
from vt.shared.config import Config, to_toml
from vt.shared.faults import fault_point
from vt.shared.log import get_logger
from vt.shared.models import spec_for
from vt.shared.progress import Progress
from vt.shared.runtime import map_large_allocations
from vt.shared.startup import StartupTimeline
from vt.shared.window import open_reader
from vt.train import refusals
from vt.train.attention import check_backend
from vt.train.checkpoint import Checkpointer
from vt.train.data import Batch, BatchReader, watermark
from vt.train.experts import expert_modules
from vt.train.export import export_path, export_run
from vt.train.model_build import Dtypes
from vt.train.parallel.batching import take_slice
from vt.train.parallel.grads import clip_grad_norm, set_gradient_sync
from vt.train.parallel.order import OrderFromRankZero
from vt.train.parallel.pp import Pipeline, pipeline_micro_step
from vt.train.parallel.pp_validation import staged_inference
from vt.train.parallel.world import setup_world, shutdown_world
from vt.train.parts import Parts, RunContext
from vt.train.plots import plot_loss
from vt.train.read_ahead import ReadAhead
from vt.train.report import ReportWriter
from vt.train.run_stats import (
    StepLog,
    StepStats,
    autocast_dtype,
    host_peak_gb,
    log_samples,
    peak_memory_gb,
    stop_if_not_finite,
    write_memory,
)
from vt.train.step import LossPath
from vt.train.trackers import Tracker
from vt.train.transformer_setup import TransformerSetup
from vt.train.validation import Validator, validation_loads
from vt.train.validation_rounds import ValidationRounds
from vt.train.window_match import WindowMatch

__all__ = ["Trainer", "autocast_dtype"]
log = get_logger("vt.train")


class Trainer:
    def __init__(self, config: Config):
        self.startup = StartupTimeline()  # <run.dir>/startup.json at the first step
        self.startup.mark("imports")
        self.config = config
        map_large_allocations()  # freed tensors go back to the OS, not to heap free lists
        self.world = setup_world(config.parallel, config.train.device, auto_layout=self._auto_layout)
        self.startup.mark("world")
        self.device, self.is_main, self.run_dir = self.world.device, self.world.is_main, config.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            (self.run_dir / "config.toml").write_text(to_toml(config))
        self._check()
        self.startup.mark("model_spec")
        self._start_model()
        self.startup.mark("model_built")
        self._start_data()
        self._start_outputs()
        self.startup.mark("window_and_validator")

    # -- set-up --------------------------------------------------------------------------------------
    def _auto_layout(self, device: torch.device):
        """parallel.dp_shard = "auto" on rank 0: replicate or shard, from the memory plan or run.dir's layout.json."""
        from vt.shared import runtime
        from vt.train.parallel.layout import cached_layout

        return cached_layout(self.config, runtime.world_size(), device, runtime.local_world_size(), self.config.run_dir)

    def _check(self) -> None:
        """The family, the parts and this machine's kernels: stop before anything is built."""
        config = self.config
        self.amp_dtype = autocast_dtype(config.train.mixed_precision, self.device)
        self.parts = Parts(config)
        check_backend(config.train.attention_backend, self.device)
        if config.validation.attention_backend:
            check_backend(
                config.validation.attention_backend, self.device, training=False, key="validation.attention_backend"
            )
        self.parts.check_machine(self.device)
        self.spec = spec_for(config)
        # The interpreter and the libraries the run uses (the family's pipeline and model classes are imported
        # by now), before anything is built or loaded: what any process using them holds (memory.json).
        self.host_baseline_gb = host_peak_gb()
        self.dtypes = self.parts.dtypes(Dtypes(self.amp_dtype, self.spec.frozen_dtype, config.train.mode))
        self.buckets = parse_buckets(config.buckets.sizes)
        for bucket in self.buckets:
            self.spec.check_bucket(bucket)
        refusals.check(config, self.spec, self.world.dims.world_size, self.parts)  # before anything is built
        if self.is_main:
            for line in self.spec.inference_mismatches():
                log.warning(line)

    def _start_model(self) -> None:
        """The transformer, its pipeline stages, the parts started on it, the optimizer and the loss path."""
        config, train = self.config, self.config.train
        self.setup = TransformerSetup(config, self.spec, self.world, self.dtypes, self.parts)
        self.transformer = self.setup.trained()
        self.pipeline = (
            Pipeline(self.transformer, self.world, config.parallel.pp_schedule) if self.world.dims.pp > 1 else None
        )
        self.run_context = RunContext(
            self.spec, self.device, self.transformer, self.world, self.empty_caption, staged=self._staged()
        )
        self.parts.start(self.run_context)  # EMA, block swap, activation offload, guidance ...
        self.startup_peak_gb = peak_memory_gb(self.device)  # the start-up phase's (memory.json, beside the plan's)
        self.params = [p for p in self.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=train.lr, weight_decay=train.weight_decay)
        self.scheduler = self.parts.scheduler(self.optimizer, train.max_steps)  # counts optimizer steps
        # draws, the forward and the loss: one path for the step and the held-out loss (train/step.py)
        self.loss_path = self.run_context.loss_path = LossPath(
            config, self.spec, self.device, self.amp_dtype, self.parts, self.run_context
        )
        flow = self.loss_path.flow  # unset keys: the family's reference recipe (docs/families.md)
        log.info("flow: %s sigmas, shift %s, loss weighting %s", flow.sigma_sampling, flow.shift, flow.loss_weighting)

    def _start_data(self) -> None:
        """The window, the shards this run takes, the batch reader (each rank reads its rows)."""
        config, train = self.config, self.config.train
        window = config.window
        self.window = open_reader(window.uri, window.size, window.poll_seconds, window.timeout_seconds)
        # The window's shards this run takes: checked against the config without reading an encoder it never loads.
        self.shards = WindowMatch(config, self.spec, self.world, loads=validation_loads(self.spec, config))
        self.run_context.shards_check = self.shards.check
        self.batch_sizes = self.parts.batch_sizes(self.spec, self.buckets)  # a token budget: by bucket
        self.reader = BatchReader(
            self.window,
            self.batch_sizes.__getitem__,
            passes=train.epochs if window.size == "keep" else 1,
            check_record=self.shards.check,
            # rank 0 writes the read position once a step (or before it waits for a commit)
            on_read=self.window.note_read if self.is_main else (lambda position: None),
            order=OrderFromRankZero(self.window, self.world),  # rank 0 lists, the rest receive
            dp_rank=self.world.dp_rank,
            dp_size=self.world.dims.dp,
            seed=train.seed,  # which of a sample's captions each epoch (several captions per clip)
        )
        self.data_state: dict | None = None  # the reader's cursor after the last batch trained (checkpoints)
        self._empty_caption: dict[str, torch.Tensor] | None = None  # read from the window when first needed

    def _start_outputs(self) -> None:
        """Checkpoints, metrics, the run page and validation."""
        config = self.config
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints")
        log_ = config.log
        self.tracker = Tracker(
            self.run_dir,
            log_.every_steps,
            log_.every_seconds,
            wandb=log_.wandb,
            tensorboard=log_.tensorboard,
            enabled=self.is_main,
        )
        self.report = ReportWriter(self.run_dir, log_.report_every_seconds, enabled=self.is_main)
        self.step_log = StepLog(log_, self.world, self.tracker, self.report)
        self.validator = Validator(
            self.spec,
            config,
            self.buckets[0],
            self.world,
            self.window,
            self.shards,
            autocast=self.amp_dtype,
            parts_dtype=self.dtypes.pipeline_parts,
            extra_parts=self.setup.untrained_experts,
        )
        self.validation = ValidationRounds(self.validator, self.parts, self.world, self.tracker)
        self.step = 0
        self._checkpointed = -1

    def _staged(self):
        """Pipeline stages: each held-out forward as one pass over the stages (parallel/pp_validation.py)."""
        if self.pipeline is None:
            return None
        return lambda: staged_inference(list(expert_modules(self.transformer).values()), self.device)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the window's shards this run trains on (taken from the first one read)."""
        return self.shards.fingerprint

    def empty_caption(self) -> dict[str, torch.Tensor]:
        """The window's empty-caption conditions (name -> one sample's tensor, float32), read once when first needed:
        caption dropout's stand-in text and the guided targets' unconditional input."""
        if self._empty_caption is None:
            stored = decode_caption(self.window.empty_caption(self.fingerprint))
            self._empty_caption = {name: tensor.float() for name, tensor in stored.items()}
        return self._empty_caption

    def resume(self) -> bool:
        path = self.checkpointer.latest() if self.config.train.resume else None
        if path is None:
            return False
        extra = self.parts.resume_state(path)
        state = self.checkpointer.load(path, self.transformer, self.optimizer, self.scheduler, extra)
        self.step = self._checkpointed = state["step"]
        self.reader.load_state_dict(state["data"])
        self.shards.load_state_dict(state.get("shards", {}))  # a checkpoint of an older vt has none
        self.data_state = state["data"]
        self.parts.after_resume(self.step)
        log.info("resumed from %s at step %d (%s)", path, self.step, self.world.dims.describe())
        return True

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            return self._run()
        finally:
            shutdown_world()

    def _run(self) -> dict:
        self.resume()
        if self.is_main:  # consumer.json's writer cleans what an earlier trainer, killed mid-write, left
            self.window.clean_consumer_debris()
        train = self.config.train
        progress = Progress(train.max_steps or None, "train", enabled=self.config.log.progress and self.is_main)
        progress.update(self.step)
        read_ahead = ReadAhead(
            self.reader, train.read_ahead_mb * 2**20, max_batches=4 * train.grad_accum, pin=self.device.type == "cuda"
        )
        batches, stats, last_loss = iter(read_ahead), StepStats(), math.nan
        unlogged: tuple[dict, StepStats] | None = None  # the latest step, if not logged yet
        while not train.max_steps or self.step < train.max_steps:
            waited = time.perf_counter()
            micro = list(islice(batches, train.grad_accum))  # every rank plans the same global batches
            stats.data_wait += time.perf_counter() - waited
            if not micro:
                break
            read_ahead.top_up()  # the next batches load while this step runs
            metrics, measured = self._one_step(micro, stats)
            unlogged = (metrics, stats)
            if measured or self.step_log.due(self.step):  # the only host reads of a step, on every rank alike
                last_loss = self.step_log.log(self.step, *unlogged)
                self.parts.logged(self.step, self.step_log.logged)
                unlogged, stats = None, StepStats()
                progress.update(1, loss=last_loss)
            else:
                progress.update(1)
            self._periodic()
        progress.close()
        read_ahead.close()
        final = self.parts.final_metrics(self.transformer, self.step) if self.step else {}
        if unlogged is not None:  # the last step always reaches the metrics, whatever the interval
            last_loss = self.step_log.log(self.step, {**unlogged[0], **final}, unlogged[1])
            self.parts.logged(self.step, self.step_log.logged)
        elif final:  # the last step's record again, with the held-out loss
            self.tracker.log(self.step, {**self.step_log.logged, **final}, force=True)
            self.parts.logged(self.step, {**self.step_log.logged, **final})
        return self.finish(last_loss)

    def _one_step(self, micro: list[Batch], stats: StepStats) -> tuple[dict, bool]:
        """Train on `micro`, count it, and add what the parts measure after it (the held-out loss when due); returns
        the metrics and whether a part measured (a step to log)."""
        if self.is_main:
            self.window.flush_read()  # backpressure: what the step and the read-ahead read (at most every poll)
        self.startup.mark("first_batch")
        if self.validation.before_step(self.transformer, self.step):
            self.startup.mark("validation_base")
        metrics = self.train_step(micro)
        self.data_state = micro[-1].state  # what a checkpoint of this step resumes from
        self.step += 1
        if "first_step" not in self.startup.marks:
            self._write_startup()
        stats.samples += sum(len(b) for b in micro)
        stats.tokens += sum(len(b) * self.spec.tokens_per_sample(b.tensors["latents"].shape[1:]) for b in micro)
        measured = self.parts.step_metrics(self.transformer, self.step)  # every rank at once
        return {**metrics, **measured}, bool(measured)

    def _periodic(self) -> None:
        every_checkpoint, every_validation = self.config.train.checkpoint_every, self.config.validation.every
        if every_checkpoint and self.step % every_checkpoint == 0:
            self.checkpoint()
        if every_validation and self.step % every_validation == 0:
            self.validate()

    def _write_startup(self) -> None:
        """<run.dir>/startup.json: seconds from launch at which each start-up part ended, up to the first step."""
        self.startup.mark("first_step")
        if self.is_main:
            (self.run_dir / "startup.json").write_text(json.dumps(self.startup.to_dict(), indent=1))

    def train_step(self, micro: list[Batch]) -> dict:
        """One optimizer step over `micro` (global micro-batches); returns global metrics.

        loss, grad_norm (and audio_loss) are 0-d device tensors that `StepLog.log` reads; here the host reads only
        whether the loss and gradient norm are finite, before the optimizer applies the step (`stop_if_not_finite`),
        and queues the optimizer and the next step while the device still runs them."""
        world, total = self.world, sum(len(b) for b in micro)  # samples in this optimizer step, all ranks
        summed, parts = self._backward(micro, scale=world.dims.dp / total)  # parallel/batching.py: N x B/N == 1 x B
        if self.pipeline is not None:  # the loss is known on the last stage only (the others add 0)
            summed = world.sum(summed, over="pp")
            self.pipeline.sum_replicated_grads()
        summed = world.sum(summed) / total  # a device collective: the host does not wait for it
        grad_norm = clip_grad_norm(self.params, self.config.train.max_grad_norm, pipeline=self.pipeline)
        stop_if_not_finite(self.step + 1, summed[0], grad_norm)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step applies (the scheduler then moves on)
        self.optimizer.step()
        self.parts.after_optimizer_step()  # fp8 scales, the average, block swap's release, the offload arena
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.config.log.samples:
            log_samples(self.run_dir, world, self.step + 1, micro, parts)
        metrics = {"loss": summed[0], "lr": lr, "grad_norm": grad_norm, "epoch": micro[-1].epoch, "batch": total}
        if self.config.model.audio:
            metrics["audio_loss"] = summed[1]
        return metrics

    def _backward(self, micro: list[Batch], scale: float) -> tuple[torch.Tensor, list]:
        """Forward and backward of this rank's slice of each micro-batch; returns the summed (loss, audio loss) of
        its samples (a float64 device tensor) and the slices."""
        world = self.world
        loss_sum = torch.zeros((), dtype=torch.float64, device=world.comm_device)  # the GPU on CUDA: no syncs
        audio_sum = torch.zeros_like(loss_sum)  # model.audio: the audio stream's share, logged
        offset, parts = 0, []
        for index, batch in enumerate(micro):
            batch = self.parts.batch(batch, offset, self.step)  # the global batch: every rank changes it alike
            part = take_slice(batch, world.dp_rank, world.dims.dp, offset)
            offset += len(batch)
            parts.append(part)
            set_gradient_sync(self.transformer, index == len(micro) - 1)  # sync once, on the last micro-step
            if self.pipeline is not None:
                per_rank = -(-self.batch_sizes[part.bucket] // world.dims.dp)
                losses_of = lambda sample, model: self.loss_path.losses(  # noqa: E731
                    model, sample, self.loss_path.draws(sample, self.step)
                )
                loss_sum += pipeline_micro_step(self.pipeline, part, per_rank, scale, losses_of)
                continue
            draws = self.loss_path.draws(part, self.step)
            for loss, audio_loss, count in self.loss_path.losses(self.transformer, part, draws):
                sample_losses = loss * count  # sum of these rows' per-sample losses
                (sample_losses * scale).backward()
                self.parts.after_backward()
                loss_sum += sample_losses.detach().double().to(loss_sum.device)
                if audio_loss is not None:
                    audio_sum += (audio_loss.detach() * count).double().to(audio_sum.device)
        return torch.stack([loss_sum, audio_sum]), parts

    def checkpoint(self) -> Path:
        """Save the step's state (every rank writes its part)."""
        if self._checkpointed == self.step:  # the periodic checkpoint already holds this step
            return self.checkpointer.latest()
        self._checkpointed = self.step
        data = self.data_state if self.data_state is not None else self.reader.state_dict()  # the last batch trained
        path = self.checkpointer.save(
            self.step,
            self.transformer,
            self.optimizer,
            self.scheduler,
            {"data": data, "shards": self.shards.state_dict()},
            self.parts.checkpoint_state(),
        )
        if self.is_main:  # the single writer of the window's consumer state
            self.window.flush_read(force=True)
            self.window.publish_watermark(watermark(data))
            evicting = self.window.evict_read(background=True)  # the deletes on a thread of their own
            log.info(
                "checkpoint %s (%s)",
                path,
                "evicting below the watermark" if evicting is None else f"evicting {len(evicting)} files",
            )
        fault_point("train.after_checkpoint")
        return path

    # -- validation and export, on the training model itself -------------------------------------------
    def validate(self) -> list[Path]:
        """Validation videos of the training model; every rank takes part (see validation.py)."""
        return self.validation.validate(self.transformer, self.step)

    def export(self) -> Path:
        """The LoRA files or full weights (every rank calls this), and each part's other exports (the EMA's average,
        in the same files, under <run.dir>/ema/)."""
        mode = self.config.train.mode
        export_run(self.transformer, self.spec, mode, self.run_dir, self.step, self.world.barrier)
        for folder, weights in self.parts.exports():
            with weights:
                export_run(self.transformer, self.spec, mode, self.run_dir / folder, self.step, self.world.barrier)
        return self.export_path()

    def export_path(self) -> Path:
        """Where `export` writes (LoRA file or model folder), known on every rank."""
        return export_path(self.spec, self.config.train.mode, self.run_dir)

    # -- the end -------------------------------------------------------------------------------------
    def finish(self, last_loss: float) -> dict:
        if self.step == 0:
            raise RuntimeError(
                "the window had no data to train on: did vt-precompute commit any shards? "
                "See its precompute_report.json"
            )
        if self.is_main:
            self.window.flush_read(force=True)  # the last read position, also when the final checkpoint is there
        self.checkpoint()
        export = self.export()
        videos = self.validate()
        self.validation.finish()
        summary = {"steps": self.step, "last_loss": last_loss, "export": str(export), "videos": len(videos)}
        write_memory(self.run_dir, self.world, self.device, self.host_baseline_gb, self.startup_peak_gb)
        if self.is_main:
            self.window.wait_evictions()
            self.tracker.close()
            plot = plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
            summary["loss_plot"] = str(plot)
            summary["report"] = str(self.report.update(final=True))
            log.info(
                "done: %d steps, last loss %.4f; weights in %s; loss plot %s; report %s",
                self.step,
                last_loss,
                export,
                plot,
                summary["report"],
            )
        self.world.barrier()
        return summary
