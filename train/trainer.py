"""The training loop: window batches -> Model Spec forward -> flow matching loss -> AdamW.

One bucket per step, no padding. Noise and sigmas come from (seed, step, micro-step, rank), the data
cursor and optimizer live in the DCP checkpoint, so a resumed run repeats the uninterrupted run's
losses exactly.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch

from vt.shared.buckets import parse_buckets
from vt.shared.config import Config, to_toml
from vt.shared.faults import fault_point
from vt.shared.log import get_logger
from vt.shared.models import build_spec
from vt.shared.provenance import describe_difference, fingerprint, provenance
from vt.shared.shards import CommitRecord, decode_shard
from vt.shared.window import Window
from vt.train.checkpoint import Checkpointer
from vt.train.data import Batch, BatchReader, StaleShardError
from vt.train.objectives import flow_matching_loss, sample_noise, sample_sigmas, step_generator
from vt.train.plots import plot_loss
from vt.train.progress import Progress
from vt.train.trackers import Tracker
from vt.train.validation import Validator

log = get_logger("vt.train")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    if setting == "no":
        return None
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if setting == "bf16" and not supported and device.type != "cpu":
        raise ValueError(f"train.mixed_precision = 'bf16' is not supported on {device}; use 'no'")
    if setting == "bf16" or supported:
        return torch.bfloat16
    return None


@dataclass
class StepStats:
    samples: int = 0
    tokens: int = 0
    data_wait: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class Trainer:
    def __init__(self, config: Config):
        self.config = config
        train = config.train
        self.run_dir = config.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(config))
        self.device = pick_device(train.device)
        self.amp_dtype = autocast_dtype(train.mixed_precision, self.device)
        self.spec = build_spec(config.model)
        self.buckets = parse_buckets(config.buckets.sizes)
        for bucket in self.buckets:
            self.spec.check_bucket(bucket)
        self.provenance = provenance(config)
        self.fingerprint = fingerprint(self.provenance)

        self.transformer = self._build_model()
        self.params = [p for p in self.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=train.lr, weight_decay=train.weight_decay)
        warmup = max(train.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

        keep = config.window.size == "keep"
        self.window = Window(config.window.uri, config.window.size, config.window.poll_seconds,
                             config.window.timeout_seconds)
        self.reader = BatchReader(self.window, train.batch_size, passes=train.epochs if keep else 1,
                                  check_record=self._check_record)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints")
        self.tracker = Tracker(self.run_dir, config.log.every_steps, config.log.every_seconds,
                               wandb=config.log.wandb, tensorboard=config.log.tensorboard)
        self.validator = Validator(self.spec, config, self.buckets[0], str(self.device))
        self.step = 0

    # -- set-up --------------------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        train = self.config.train
        torch.manual_seed(train.seed)  # LoRA initialisation: the same adapters in every run and on every rank
        transformer = self.spec.load_transformer(device=str(self.device))
        if train.mode == "lora":
            transformer.requires_grad_(False)
            self.spec.add_lora(transformer, train.lora_rank, train.lora_alpha, train.lora_targets or None)
        else:
            transformer.requires_grad_(True)
        for p in transformer.parameters():  # fp32 master weights for whatever trains
            if p.requires_grad:
                p.data = p.data.float()
        transformer.train()
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        total = sum(p.numel() for p in transformer.parameters())
        log.info("%s %s: %.2fM trainable of %.2fM parameters on %s", self.spec.family, train.mode,
                 trainable / 1e6, total / 1e6, self.device)
        return transformer

    def _check_record(self, record: CommitRecord, data: bytes) -> None:
        if record.fingerprint == self.fingerprint:
            return
        _, _, meta = decode_shard(data)
        found = meta.get("provenance", {})
        raise StaleShardError(
            f"shard {record.data} was made with other settings than this config "
            f"({describe_difference(self.provenance, found)}). Re-run vt-precompute into a fresh window "
            f"(window.uri) or point the trainer at a config that matches.")

    def resume(self) -> bool:
        path = self.checkpointer.latest() if self.config.train.resume else None
        if path is None:
            return False
        state = self.checkpointer.load(path, self.transformer, self.optimizer, self.scheduler)
        self.step = state["step"]
        self.reader.load_state_dict(state["data"])
        log.info("resumed from %s at step %d", path, self.step)
        return True

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> dict:
        self.resume()
        train = self.config.train
        total = train.max_steps or None
        progress = Progress(total, "train", enabled=self.config.log.progress)
        progress.update(self.step)
        batches = iter(self.reader)
        stats = StepStats()
        last_loss = math.nan
        while not train.max_steps or self.step < train.max_steps:
            waited = time.perf_counter()
            micro = list(islice(batches, train.grad_accum))
            stats.data_wait += time.perf_counter() - waited
            if not micro:
                break
            metrics = self.train_step(micro)
            self._log_samples(micro)
            self.step += 1
            last_loss = metrics["loss"]
            stats.samples += sum(len(b) for b in micro)
            stats.tokens += sum(len(b) * b.tensors["latents"][0, 0].numel() for b in micro)
            if self.tracker.due(self.step):
                elapsed = max(time.perf_counter() - stats.started, 1e-9)
                metrics.update(samples_s=stats.samples / elapsed, tokens_s=stats.tokens / elapsed,
                               data_wait_s=stats.data_wait)
                self.tracker.log(self.step, metrics)
                stats = StepStats()
            progress.update(1, loss=last_loss)
            if train.checkpoint_every and self.step % train.checkpoint_every == 0:
                self.checkpoint()
            if train.validate_every and self.step % train.validate_every == 0:
                self.validator.run(self.transformer, self.step)
        progress.close()
        return self.finish(last_loss)

    def train_step(self, micro: list[Batch]) -> dict:
        train = self.config.train
        total = sum(len(b) for b in micro)
        loss_sum = 0.0
        for index, batch in enumerate(micro):
            tensors = {k: v.to(self.device) for k, v in batch.tensors.items()}
            generator = step_generator(train.seed, self.step, index)
            sigmas = sample_sigmas(len(batch), train.sigma_sampling, train.shift, generator).to(self.device)
            noise = sample_noise(tensors["latents"], generator)
            with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                enabled=self.amp_dtype is not None):
                out = self.spec.forward(self.transformer, tensors, sigmas, noise, generator=generator)
            loss = flow_matching_loss(out) * (len(batch) / total)
            loss.backward()
            loss_sum += loss.item()
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"loss is {loss_sum} at step {self.step}; lower train.lr or check the data")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, train.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum, "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                "epoch": micro[-1].epoch, "batch": total}

    def _log_samples(self, micro: list[Batch]) -> None:
        if not self.config.log.samples:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for batch in micro:
                f.write(json.dumps({"step": self.step, "epoch": batch.epoch, "bucket": batch.bucket,
                                    "keys": batch.keys}) + "\n")

    def checkpoint(self) -> Path:
        path = self.checkpointer.save(self.step, self.transformer, self.optimizer, self.scheduler,
                                      {"data": self.reader.state_dict()})
        self.window.publish_watermark(self.reader.watermark())
        evicted = self.window.evict()
        log.info("checkpoint %s (evicted %d shards)", path, len(evicted))
        fault_point("train.after_checkpoint")
        return path

    # -- the end -------------------------------------------------------------------------------------
    def finish(self, last_loss: float) -> dict:
        if self.step == 0:
            raise RuntimeError("the window had no data to train on: did vt-precompute commit any shards? "
                               "See its precompute_report.json")
        self.checkpoint()
        export = self.export()
        videos = self.validator.run(self.transformer, self.step)
        self.tracker.close()
        plot = plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
        summary = {"steps": self.step, "last_loss": last_loss, "export": str(export),
                   "videos": len(videos), "loss_plot": str(plot)}
        log.info("done: %d steps, last loss %.4f; weights in %s; loss plot %s", self.step, last_loss, export, plot)
        return summary

    def export(self) -> Path:
        if self.config.train.mode == "lora":
            from peft.utils import get_peft_model_state_dict

            return self.spec.save_lora(get_peft_model_state_dict(self.transformer), self.run_dir / "lora")
        return self.spec.save_full(self.transformer, self.run_dir / "model")
