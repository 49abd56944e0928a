"""The training loop: window batches -> Model Spec forward -> flow matching loss -> AdamW.

One bucket per step, no padding. The same loop runs as one process or under torchrun: every rank
reads the same global batches and trains on its data-parallel slice (parallel/batching.py); the
model is wrapped by `parallelize` (pipeline stages, TP, CP, activation checkpointing, compile,
FSDP2/HSDP or DDP); with pipeline stages a rank's slice runs through torch.distributed.pipelining's
schedule one sample per microbatch (`_pipeline_micro_step`, parallel/pp.py). Draws, caption dropout, the forward
and the loss are one path (train/step.py), which the held-out loss shares. Noise and sigmas come from (seed, step, sample index), the data cursor and optimizer live in the
DCP checkpoint, so a resumed run, at any world size with the same global batch, repeats the
uninterrupted run's losses. Rank 0 alone writes metrics, window consumer state, exports and plots.
A step reads one thing back to the host, whether its loss and gradient norm are finite (a non-finite one stops
the run before the optimizer applies it); the metrics stay device tensors until a step is logged (every rank
decides that alike, `_log_due`).
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch

from vt.shared.buckets import parse_buckets
from vt.shared.caption_table import decode_caption
from vt.shared.config import Config, to_toml
from vt.shared.errors import UserError
from vt.shared.faults import fault_point
from vt.shared.host_memory import pinned_bytes
from vt.shared.log import get_logger
from vt.shared.models import spec_for
from vt.shared.models.components import keeps_float32
from vt.shared.progress import Progress
from vt.shared.runtime import map_large_allocations
from vt.shared.startup import StartupTimeline
from vt.shared.window import open_reader
from vt.train import refusals
from vt.train.attention import backend_for, check_backend, set_backend
from vt.train.checkpoint import Checkpointer
from vt.train.data import Batch, BatchReader, bucket_batch_sizes, watermark
from vt.train.ema import EMA, checkpoint_has_ema
from vt.train.eval_loss import HeldOut
from vt.train.experts import expert_modules
from vt.train.export import lora_states, write_full_weights
from vt.train.fp8 import after_optimizer_step, apply_fp8_training, check_fp8_training
from vt.train.guidance import guidance_for
from vt.train.model_build import Dtypes, build_transformer
from vt.train.parallel import parallelize
from vt.train.parallel.batching import Slice, take_slice
from vt.train.parallel.block_swap import BlockSwap, swapped_blocks
from vt.train.parallel.grads import clip_grad_norm, set_gradient_sync
from vt.train.parallel.offload import OffloadSaved
from vt.train.parallel.order import OrderFromRankZero
from vt.train.parallel.pp import Pipeline, one_sample_microbatches
from vt.train.parallel.pp_validation import staged_inference
from vt.train.parallel.world import setup_world, shutdown_world
from vt.train.plots import plot_loss
from vt.train.read_ahead import ReadAhead
from vt.train.report import ReportWriter
from vt.train.step import LossPath
from vt.train.trackers import Tracker
from vt.train.validation import Validator, validation_loads
from vt.train.window_match import WindowMatch

__all__ = ["Trainer", "autocast_dtype"]
log = get_logger("vt.train")


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    if setting == "no":
        return None
    supported = device.type != "cpu" and _bf16_supported(device)
    if setting == "bf16" and not supported and device.type != "cpu":
        raise UserError(f"train.mixed_precision = 'bf16' is not supported on {device}; use 'no'")
    if setting == "bf16" or supported:
        return torch.bfloat16
    return None


def _bf16_supported(device: torch.device) -> bool:
    """Whether `device`'s backend (torch.cuda, torch.xpu, or any registered one) computes in bfloat16."""
    check = getattr(getattr(torch, device.type, None), "is_bf16_supported", None)
    return bool(check is not None and check())


def host_peak_gb() -> float:
    """This process's peak resident set so far, in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def host_values(metrics: dict) -> dict:
    """`metrics` with its tensors read to Python floats, in one host read (one sync on a GPU)."""
    names = [name for name, value in metrics.items() if isinstance(value, torch.Tensor)]
    if not names:
        return dict(metrics)
    device = metrics[names[0]].device
    read = torch.stack([metrics[name].detach().to(device, torch.float64).reshape(()) for name in names]).tolist()
    return {**metrics, **dict(zip(names, read))}


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory: allocated GPU memory on CUDA, peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_gb()


@dataclass
class StepStats:
    samples: int = 0
    tokens: int = 0
    data_wait: float = 0.0
    started: float = field(default_factory=time.perf_counter)


def stop_if_not_finite(step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Raise FloatingPointError before the optimizer applies a step whose loss or gradient norm is NaN or infinite.
    Both are global (summed and combined over every rank), so every rank raises together, with no collective: the
    step's one host read (the CPU waits for the backward here, not for the optimizer or the next step's inputs)."""
    loss_value, norm = torch.stack([loss.double(), grad_norm.to(loss.device, torch.float64)]).tolist()
    if math.isfinite(loss_value) and math.isfinite(norm):
        return
    what = f"loss is {loss_value}" if not math.isfinite(loss_value) else f"gradient norm is {norm} (loss {loss_value})"
    raise FloatingPointError(
        f"{what} at step {step}, which the optimizer did not apply (the weights are step "
        f"{step - 1}'s, as in its checkpoint); lower train.lr or check the data"
    )


class Trainer:
    def __init__(self, config: Config):
        self.startup = StartupTimeline()  # <run.dir>/startup.json at the first step
        self.startup.mark("imports")
        self.config = config
        map_large_allocations()  # freed tensors go back to the OS, not to heap free lists
        train = config.train
        self.world = setup_world(config.parallel, train.device, auto_layout=self._auto_layout)
        self.startup.mark("world")
        self.device = self.world.device
        self.is_main = self.world.is_main
        self.run_dir = config.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            (self.run_dir / "config.toml").write_text(to_toml(config))
        self.amp_dtype = autocast_dtype(train.mixed_precision, self.device)
        self._check_kernels()
        self.spec = spec_for(config)
        # The interpreter and the libraries the run uses (the family's pipeline and model classes are imported
        # by now), before anything is built or loaded: what any process using them holds (memory.json).
        self.host_baseline_gb = host_peak_gb()
        self.dtypes = Dtypes(self.amp_dtype, self.spec.frozen_dtype, train.mode, train.fp8_base_weights)
        self.buckets = parse_buckets(config.buckets.sizes)
        for bucket in self.buckets:
            self.spec.check_bucket(bucket)
        refusals.check(config, self.spec, self.world.dims.world_size)  # before anything is built
        if self.is_main:
            for line in self.spec.inference_mismatches():
                log.warning(line)
        self.startup.mark("model_spec")

        self.transformer = self._build_model()
        self.pipeline = (
            Pipeline(self.transformer, self.world, config.parallel.pp_schedule) if self.world.dims.pp > 1 else None
        )
        self.block_swap = self._swap_blocks()  # parallel.blocks_on_gpu (parallel/block_swap.py); None: off
        self.startup.mark("model_built")
        self.startup_peak_gb = peak_memory_gb(self.device)  # the start-up phase's (memory.json, beside the plan's)
        self.params = [p for p in self.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=train.lr, weight_decay=train.weight_decay)
        self.ema = EMA(self.transformer, train.ema_decay) if train.ema_decay else None  # train/ema.py
        # parallel.activation_offload: what the step saves for backward waits in host memory (parallel/offload.py)
        self.offload = OffloadSaved(self.device) if config.parallel.activation_offload else None
        warmup = max(train.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(  # counts optimizer steps, not micro-steps
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

        keep = config.window.size == "keep"
        self.window = open_reader(
            config.window.uri, config.window.size, config.window.poll_seconds, config.window.timeout_seconds
        )
        # The window's shards this run takes: checked against the config without reading an encoder it never loads.
        self.shards = WindowMatch(config, self.spec, self.world, loads=validation_loads(self.spec, config))
        self.batch_sizes = bucket_batch_sizes(train, self.spec, self.buckets)  # train.tokens_per_batch: by bucket
        self.reader = BatchReader(
            self.window,
            self.batch_sizes.__getitem__,
            passes=train.epochs if keep else 1,
            check_record=self.shards.check,
            # rank 0 writes the read position once a step (or before it waits for a commit)
            on_read=self.window.note_read if self.is_main else (lambda position: None),
            order=OrderFromRankZero(self.window, self.world),  # rank 0 lists, the rest receive
            dp_rank=self.world.dp_rank,
            dp_size=self.world.dims.dp,
        )  # each reads its rows
        self.data_state: dict | None = None  # the reader's cursor after the last batch trained (checkpoints)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints")
        self.tracker = Tracker(
            self.run_dir,
            config.log.every_steps,
            config.log.every_seconds,
            wandb=config.log.wandb,
            tensorboard=config.log.tensorboard,
            enabled=self.is_main,
        )
        self.report = ReportWriter(self.run_dir, config.log.report_every_seconds, enabled=self.is_main)
        self.validator = Validator(
            self.spec,
            config,
            self.buckets[0],
            self.world,
            self.window,
            self.shards,
            autocast=self.amp_dtype,
            parts_dtype=self.dtypes.pipeline_parts,
            extra_parts=self._untrained_experts,
        )
        self._frozen_experts: dict[str, torch.nn.Module] | None = None  # validation's other experts (one-expert runs)
        self.step = 0
        self._checkpointed = -1
        self._validated: tuple[int, list[Path]] = (-1, [])  # the last validated step and its videos
        self._empty_caption: dict[str, torch.Tensor] | None = None  # read from the window when first needed
        self.guidance = guidance_for(config, self.spec, self.empty_caption)  # train.guidance_scale: train/guidance.py
        # draws, caption dropout, forward and loss: one path for the step and the held-out loss (train/step.py)
        self.loss_path = LossPath(
            config,
            self.spec,
            self.device,
            self.amp_dtype,
            self.empty_caption,
            guidance=self.guidance,
            offload=self.offload,
        )
        # data.eval: the held-out loss every train.eval_every steps and at the end (train/eval_loss.py)
        self.held_out = (
            HeldOut(
                config,
                self.spec,
                self.world,
                self.shards.check,
                self.loss_path.losses,
                inference=self._staged if self.pipeline is not None else None,
            )
            if config.data.eval
            else None
        )
        self._evaluated = -1  # the last step the held-out loss was computed at
        self._logged: dict = {}  # the last logged step's values (a final held-out loss joins them)
        self.startup.mark("window_and_validator")

    # -- set-up --------------------------------------------------------------------------------------
    def _auto_layout(self, device: torch.device):
        """parallel.dp_shard = "auto" on rank 0: replicate or shard, from the memory plan or run.dir's layout.json."""
        from vt.shared import runtime
        from vt.train.parallel.layout import cached_layout

        return cached_layout(self.config, runtime.world_size(), device, runtime.local_world_size(), self.config.run_dir)

    def _check_kernels(self) -> None:
        """Attention backends, fp8 and CPU offload: stop at start-up when this machine cannot run them."""
        train = self.config.train
        check_backend(train.attention_backend, self.device)
        if train.validation_attention_backend:
            check_backend(
                train.validation_attention_backend,
                self.device,
                training=False,
                key="train.validation_attention_backend",
            )
        check_fp8_training(train, self.device)

    def _build_transformer(self, component: str, mode: str) -> torch.nn.Module:
        """Transformer `component` built on the meta device, laid out by the run's parallel plan and filled
        (train/model_build.py); `mode` "lora", "full" or "frozen" (validation's other expert)."""
        train, parallel, dims = self.config.train, self.config.parallel, self.world.dims
        trains = mode != "frozen"
        param_dtype = self.dtypes.param_dtype(mode)  # what FSDP2's all-gather casts to

        def lay_out(model: torch.nn.Module, materialize) -> None:
            if train.fp8_training != "none" and trains:
                apply_fp8_training(model, train.fp8_training, fsdp=dims.fsdp_enabled)
            parallelize(
                model,
                self.spec,
                self.world,
                activation_checkpointing=parallel.activation_checkpointing and trains,
                compile=parallel.compile and trains,
                param_dtype=param_dtype if dims.fsdp_enabled else None,
                cpu_offload=parallel.cpu_offload,
                materialize=materialize,
            )

        lora = {
            "rank": train.lora_rank,
            "alpha": train.lora_alpha,
            "targets": train.lora_targets,
            "kind": train.adapter,
        }
        resident = parallel.blocks_on_gpu if trains else None  # block swap: those blocks built in host memory
        return build_transformer(
            self.spec,
            component,
            self.world,
            mode=mode,
            lora=lora,
            storage_dtype=self.dtypes.storage(mode),
            compute_dtype=self.dtypes.compute,
            frozen_dtype=self.dtypes.frozen,
            parallelize=lay_out,
            seed=train.seed,
            cpu_offload=parallel.cpu_offload and dims.fsdp_enabled,
            quantize=train.quantize_base,
            host_blocks=None if resident is None else lambda model: swapped_blocks(self.spec, model, resident),
        )

    def _swap_blocks(self) -> BlockSwap | None:
        resident = self.config.parallel.blocks_on_gpu
        if resident is None:
            return None
        blocks = [block for _, block in self.spec.named_blocks(self.transformer)]
        swap = BlockSwap(blocks, resident, self.device)
        log.info(
            "block swap: %d of %d blocks on %s, %d in host memory",
            min(resident, len(blocks)),
            len(blocks),
            self.device,
            len(swap.swapped),
        )
        return swap

    def _build_model(self) -> torch.nn.Module:
        """The trained transformer, or for a run over all experts an nn.ModuleDict expert -> transformer,
        each laid out by the same plan."""
        train = self.config.train
        torch.manual_seed(train.seed)
        experts = self.spec.trained_experts
        if experts:
            transformer = torch.nn.ModuleDict(
                {name: self._build_transformer(component, train.mode) for name, component in experts.items()}
            )
        else:
            transformer = self._build_transformer(self.spec.trained_component, train.mode)
        transformer.train()
        modules = set_backend(transformer, train.attention_backend)
        log.info("attention backend %s (diffusers dispatcher, %d attention modules)", train.attention_backend, modules)
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        total = sum(p.numel() for p in transformer.parameters())
        log.info(
            "%s %s: %.2fM trainable of %.2fM parameters on %s",
            self.spec.family,
            train.mode,
            trainable / 1e6,
            total / 1e6,
            self.device,
        )
        return transformer

    def _untrained_experts(self) -> dict[str, torch.nn.Module]:
        """The experts a one-expert run does not train, frozen and laid out like the trained one, for the
        validation pipeline (built once, at the first validation)."""
        if self._frozen_experts is None:
            trained = set(self.spec.trained_experts.values()) or {self.spec.trained_component}
            others = [component for component, _ in self.spec.experts().values() if component not in trained]
            self._frozen_experts = {
                component: self._build_transformer(component, "frozen").eval() for component in others
            }
        return self._frozen_experts

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the window's shards this run trains on (taken from the first one read)."""
        return self.shards.fingerprint

    def resume(self) -> bool:
        path = self.checkpointer.latest() if self.config.train.resume else None
        if path is None:
            return False
        extra = None
        if self.ema is not None and checkpoint_has_ema(path):
            extra = {"ema": self.ema.state_dict()}
        elif self.ema is not None:
            log.warning(
                "%s holds no average of the weights (train.ema_decay was off): it starts from the resumed weights", path
            )
        state = self.checkpointer.load(path, self.transformer, self.optimizer, self.scheduler, extra)
        self.step = self._checkpointed = state["step"]
        self.reader.load_state_dict(state["data"])
        self.shards.load_state_dict(state.get("shards", {}))  # a checkpoint of an older vt has none
        self.data_state = state["data"]
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
        batches = iter(read_ahead)
        stats = StepStats()
        last_loss = math.nan
        unlogged: tuple[dict, StepStats] | None = None  # the latest step, if not logged yet
        while not train.max_steps or self.step < train.max_steps:
            waited = time.perf_counter()
            micro = list(islice(batches, train.grad_accum))  # every rank plans the same global batches
            stats.data_wait += time.perf_counter() - waited
            if not micro:
                break
            read_ahead.top_up()  # the next batches load while this step runs
            if self.is_main:
                self.window.flush_read()  # backpressure: what the step and the read-ahead read (at most every poll)
            self.startup.mark("first_batch")
            if self.validator.enabled:
                self.validator.conditions()  # the window has them once a shard is there: stop now if it lacks them
            metrics = self.train_step(micro)
            self.data_state = micro[-1].state  # what a checkpoint of this step resumes from
            self.step += 1
            if "first_step" not in self.startup.marks:
                self._write_startup()
            stats.samples += sum(len(b) for b in micro)
            stats.tokens += sum(
                len(b) * self.spec.tokens_per_sample(b.tensors["latents"].shape[1:]) for b in micro
            )  # transformer tokens of the whole job
            evaluate = self.held_out is not None and train.eval_every and self.step % train.eval_every == 0
            if evaluate:  # every rank at once (its forwards are sharded like the training step's)
                metrics.update(self.evaluate())
            unlogged = (metrics, stats)
            if evaluate or self._log_due():  # the only host reads of a step, on every rank alike
                last_loss = self._log_step(*unlogged)
                unlogged, stats = None, StepStats()
                progress.update(1, loss=last_loss)
            else:
                progress.update(1)
            if train.checkpoint_every and self.step % train.checkpoint_every == 0:
                self.checkpoint()
            if train.validate_every and self.step % train.validate_every == 0:
                self.validate()
        progress.close()
        read_ahead.close()
        final = self.evaluate() if self.held_out is not None and 0 < self.step != self._evaluated else {}
        if unlogged is not None:  # the last step always reaches the metrics, whatever the interval
            last_loss = self._log_step({**unlogged[0], **final}, unlogged[1])
        elif final:  # the last step's record again, with the held-out loss
            self.tracker.log(self.step, {**self._logged, **final}, force=True)
        return self.finish(last_loss)

    def evaluate(self) -> dict[str, float]:
        """The held-out loss of the model as it is now, or with train.ema_eval of its average (every rank calls it;
        train/eval_loss.py)."""
        self._evaluated = self.step
        average = self.ema is not None and self.config.train.ema_eval
        with self.ema.swapped_in() if average else contextlib.nullcontext():
            return self.held_out.evaluate(self.transformer)

    def _staged(self):
        """Each held-out forward as one pass over the pipeline stages (parallel/pp_validation.py)."""
        return staged_inference(list(expert_modules(self.transformer).values()), self.device)

    def _write_startup(self) -> None:
        """<run.dir>/startup.json: seconds from launch at which each start-up part ended, up to the first step."""
        self.startup.mark("first_step")
        if self.is_main:
            (self.run_dir / "startup.json").write_text(json.dumps(self.startup.to_dict(), indent=1))

    def _log_due(self) -> bool:
        """Whether this step is logged, the same answer on every rank: `_log_step` holds collectives.

        By steps every rank computes it; by seconds rank 0's tracker decides (the others' are disabled)
        and, in a distributed run, broadcasts it over the CPU backend (no GPU sync)."""
        every_steps, every_seconds = self.config.log.every_steps, self.config.log.every_seconds
        if every_steps and self.step % every_steps == 0:
            return True
        if not every_seconds:
            return False
        return bool(self.world.broadcast_object(self.tracker.due(self.step)))

    def _log_step(self, metrics: dict, stats: StepStats) -> float:
        """The step's metrics plus rates since the last log (samples, transformer tokens) and peak memory;
        returns its loss. Every rank calls it at the same steps (`_log_due`): it gathers each rank's peak memory."""
        values = host_values(metrics)  # the one read of the step's device tensors
        elapsed = max(time.perf_counter() - stats.started, 1e-9)
        values.update(samples_s=stats.samples / elapsed, tokens_s=stats.tokens / elapsed, data_wait_s=stats.data_wait)
        memory = self.world.gather_floats(peak_memory_gb(self.device))
        values.update({f"peak_mem_gb/rank{r}": m for r, m in enumerate(memory)})
        self.tracker.log(self.step, values, force=True)
        self._logged = values
        self.report.update()  # report.html, at most every log.report_every_seconds
        return values["loss"]

    def train_step(self, micro: list[Batch]) -> dict:
        """One optimizer step over `micro` (global micro-batches); returns global metrics.

        loss, grad_norm (and audio_loss) are 0-d device tensors that `_log_step` reads; here the host reads only
        whether the loss and gradient norm are finite, before the optimizer applies the step (`stop_if_not_finite`),
        and queues the optimizer and the next step while the device still runs them."""
        train, world = self.config.train, self.world
        total = sum(len(b) for b in micro)  # samples in this optimizer step, all ranks
        scale = world.dims.dp / total  # see parallel/batching.py: N ranks x B/N == 1 rank x B
        loss_sum = torch.zeros((), dtype=torch.float64, device=world.comm_device)  # the GPU on CUDA: no syncs
        audio_sum = torch.zeros_like(loss_sum)  # model.audio: the audio stream's share, logged
        offset, parts = 0, []
        for index, batch in enumerate(micro):
            batch = self.loss_path.drop_captions(batch, offset, self.step)  # the global batch: every rank drops alike
            part = take_slice(batch, world.dp_rank, world.dims.dp, offset)
            offset += len(batch)
            parts.append(part)
            set_gradient_sync(self.transformer, index == len(micro) - 1)  # sync once, on the last micro-step
            if self.pipeline is not None:
                loss_sum += self._pipeline_micro_step(part, scale)
                continue
            draws = self.loss_path.draws(part, self.step)
            for loss, audio_loss, count in self.loss_path.losses(self.transformer, part, draws):
                sample_losses = loss * count  # sum of these rows' per-sample losses
                (sample_losses * scale).backward()
                if self.offload is not None:
                    self.offload.done()  # every saved tensor came back: the host arena is free again
                loss_sum += sample_losses.detach().double().to(loss_sum.device)
                if audio_loss is not None:
                    audio_sum += (audio_loss.detach() * count).double().to(audio_sum.device)
        summed = torch.stack([loss_sum, audio_sum])
        if self.pipeline is not None:  # the loss is known on the last stage only (the others add 0)
            summed = world.sum(summed, over="pp")
            self.pipeline.sum_replicated_grads()
        summed = world.sum(summed) / total  # a device collective: the host does not wait for it
        loss = summed[0]
        grad_norm = clip_grad_norm(self.params, train.max_grad_norm, pipeline=self.pipeline)
        stop_if_not_finite(self.step + 1, loss, grad_norm)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step applies (the scheduler then moves on)
        self.optimizer.step()
        if train.fp8_training != "none":
            after_optimizer_step(self.transformer, train.fp8_training, fsdp=world.dims.fsdp_enabled)
        if self.ema is not None:
            self.ema.update()
        if self.block_swap is not None:
            self.block_swap.release()
        if self.offload is not None:
            self.offload.done()  # (pipeline stages: the step's backwards are over only now)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._log_samples(micro, parts)
        metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "epoch": micro[-1].epoch, "batch": total}
        if self.config.model.audio:
            metrics["audio_loss"] = summed[1]
        return metrics

    def _pipeline_micro_step(self, part: Slice, scale: float) -> torch.Tensor:
        """Forward and backward of this rank's slice through the pipeline stages (parallel.pp > 1), one sample
        per microbatch; returns the sum of its per-sample losses on the last stage (0 on the others)."""
        per_rank = -(-self.batch_sizes[part.bucket] // self.world.dims.dp)  # per bucket: stand-ins pad a smaller one
        microbatches = one_sample_microbatches(part, max(per_rank, self.world.dims.pp))
        losses: dict[int, torch.Tensor] = {}

        def run(m: int, transformer: torch.nn.Module) -> torch.Tensor:
            sample = microbatches[m]
            losses_of = self.loss_path.losses(transformer, sample, self.loss_path.draws(sample, self.step))
            total = sum(loss * count for loss, _, count in losses_of)
            losses[m] = total.detach().double()
            return total * scale

        key = (part.bucket, *(tuple(t.shape[1:]) for t in part.tensors.values()))
        self.pipeline.run(key, len(microbatches), run)
        if not self.pipeline.split.is_last:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return sum(losses[m] for m in range(len(microbatches)))

    def empty_caption(self) -> dict[str, torch.Tensor]:
        """The window's empty-caption conditions (name -> one sample's tensor, float32), read once when first needed:
        caption dropout's stand-in text and the guided targets' unconditional input."""
        if self._empty_caption is None:
            stored = decode_caption(self.window.empty_caption(self.fingerprint))
            self._empty_caption = {name: tensor.float() for name, tensor in stored.items()}
        return self._empty_caption

    def _log_samples(self, micro: list[Batch], parts: list[Slice]) -> None:
        """log.samples: the step's global keys (rank 0) and, when distributed, each rank's own slice."""
        if not self.config.log.samples:
            return
        step = self.step + 1  # the number this step gets in metrics.jsonl and checkpoints
        if self.is_main:
            with open(self.run_dir / "samples.jsonl", "a") as f:
                for batch in micro:
                    f.write(
                        json.dumps({"step": step, "epoch": batch.epoch, "bucket": batch.bucket, "keys": batch.keys})
                        + "\n"
                    )
        if self.world.dims.distributed:
            folder = self.run_dir / "samples"
            folder.mkdir(exist_ok=True)
            coordinate = self.world.dims.coordinate(self.world.rank)
            with open(folder / f"rank{self.world.rank}.jsonl", "a") as f:
                for index, part in enumerate(parts):
                    f.write(
                        json.dumps(
                            {
                                "step": step,
                                "micro": index,
                                "epoch": part.epoch,
                                "bucket": part.bucket,
                                "keys": part.keys,
                                "dp_rank": self.world.dp_rank,
                                **coordinate,
                            }
                        )
                        + "\n"
                    )

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
            {"ema": self.ema.state_dict()} if self.ema is not None else None,
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
        if not self.validator.enabled:
            return []
        if self._validated[0] == self.step:  # the periodic validation already rendered this step
            return self._validated[1]
        train = self.config.train
        average = self.ema.swapped_in() if self.ema is not None and train.ema_validation else contextlib.nullcontext()
        with (
            backend_for(
                self.transformer,
                train.validation_attention_backend or train.attention_backend,
                restore=train.attention_backend,
            ),
            average,
        ):
            videos = self.validator.run(self.transformer, self.step)
        self.world.barrier()
        self._validated = (self.step, videos)
        return videos

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
        summary = {"steps": self.step, "last_loss": last_loss, "export": str(export), "videos": len(videos)}
        self._write_memory()
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

    def _write_memory(self) -> None:
        """<run.dir>/memory.json: every rank's peak over the whole run (validation and export included):
        host resident set, the part of it that was there before the trainer built anything (imports), the host
        memory vt page-locked (block swap's and activation offload's arenas), and on CUDA the peak allocated GPU
        memory, over the run and over start-up alone. Every rank calls it (a gather)."""
        memory = {
            "host_peak_gb": self.world.gather_floats(host_peak_gb()),
            "host_baseline_gb": self.world.gather_floats(self.host_baseline_gb),
            "host_pinned_gb": self.world.gather_floats(pinned_bytes() / 2**30),
        }
        if self.device.type == "cuda":
            memory["gpu_peak_gb"] = self.world.gather_floats(peak_memory_gb(self.device))
            memory["gpu_startup_peak_gb"] = self.world.gather_floats(self.startup_peak_gb)
        if self.is_main:
            (self.run_dir / "memory.json").write_text(json.dumps(memory, indent=1))

    def export(self) -> Path:
        """The LoRA files or full weights (every rank calls this); a run over all experts writes each expert's
        (LoRA files named after the expert, full weights in model/<its pipeline component>/). With
        train.ema_decay the average's, in the same files, under <run.dir>/ema/."""
        self._export_to(self.run_dir)
        if self.ema is not None:
            with self.ema.swapped_in():
                self._export_to(self.run_dir / "ema")
        return self.export_path()

    def _export_to(self, root: Path) -> None:
        if self.config.train.mode == "lora":
            for expert, tensors in lora_states(self.transformer).items():  # {} off rank 0
                self.spec.save_lora(tensors, root / "lora", expert=expert, step=self.step)
            self.world.barrier()
            return
        experts = self.spec.trained_experts
        for expert, module in expert_modules(self.transformer).items():
            folder = root / "model" / experts[expert] if expert else root / "model"
            write_full_weights(
                module,
                folder,
                dtype_of=lambda name, tensor, module=module: (
                    torch.float32 if keeps_float32(module, name) else self.spec.frozen_dtype
                ),
            )

    def export_path(self) -> Path:
        """Where `export` writes (LoRA file or model folder), known on every rank."""
        if self.spec.trains_all_experts:  # one file or folder per expert in it
            return self.run_dir / ("lora" if self.config.train.mode == "lora" else "model")
        if self.config.train.mode == "lora":
            return self.run_dir / "lora" / "pytorch_lora_weights.safetensors"
        return self.run_dir / "model"
