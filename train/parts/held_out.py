"""The held-out loss: the flow-matching loss over samples never trained on, at a fixed grid of sigmas with fixed noise.

`data.eval` names raw data (as `data.raw` does) that `vt-precompute run` encodes first, into the window's `eval/`
prefix (`shared.window.eval_window_uri`): a window of its own, kept, never in the training order. Every
`held_out.every` optimizer steps (and at the end) the trainer computes, for each held-out sample and each sigma of
`held_out.sigmas`, the loss of the model's prediction at that sigma with noise drawn once per sample from a key
of its own, so two evaluations differ only by the weights: it is the curve to compare runs and steps by, where the
training loss moves with each step's random sigmas and noise.

The work is shared by the data-parallel ranks as a batch is (each bucket's samples sliced by `slice_bounds`, a rank
with fewer runs weight-0 stand-ins, so sharded forwards stay in step); each transformer call takes one sample at one
sigma, so the number does not depend on how the samples were sliced, and the per-sample losses are summed over the
data-parallel ranks into one table (zeros elsewhere: the sum is exact) that every rank reduces in the same order.
Under pipeline parallel each call runs over the stages (parallel/pp_validation.py). The eval set is read once, at
the first evaluation, and held in host memory: it is meant to be small (tens of clips).

Logged as `eval_loss` (the mean over samples and sigmas) and `eval_loss/sigma_<s>` (per sigma), beside the training
loss in metrics.jsonl, the trackers and the run page. The gap between it and the training loss is plotted on the page,
and a warning logged (and shown there) when it widens (train/loss_gap.py defines both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.shared.runtime import keyed_generator
from vt.shared.window import eval_window_uri, open_reader
from vt.train.data import Batch, BatchReader
from vt.train.loss_gap import WINDOW, gaps, widening
from vt.train.objectives import sample_noise
from vt.train.parallel.batching import Slice, take_slice
from vt.train.parts.base import Part, RunContext
from vt.train.step import Draws

log = get_logger("vt.train.held_out")


def fixed_draws(sample: Slice, sigmas: list[float], seed: int, levels: int, independent_audio: bool) -> Iterator[Draws]:
    """The draws of a one-row slice (sample `sample.first_index` of the eval set) at each of `sigmas`: the same
    noise at every sigma and every evaluation, on keys of their own; the spec's generator drawn anew for each."""
    index = sample.first_index
    noise = sample_noise(sample.tensors["latents"], keyed_generator(seed, "eval", "noise", index))
    audio = sample.tensors.get("audio_latents")
    audio_noise = None if audio is None else sample_noise(audio, keyed_generator(seed, "eval", "audio", index))
    for sigma in sigmas:
        yield Draws(
            torch.full((1,) if levels == 1 else (1, levels), float(sigma)),
            noise,
            [keyed_generator(seed, "eval", "spec", index)],
            audio_noise,
            torch.full((1,), float(sigma)) if audio is not None and independent_audio else None,
        )


def one_row(part: Slice, row: int) -> Slice:
    return Slice(
        part.bucket,
        part.epoch,
        part.keys[row : row + 1],
        {k: v[row : row + 1] for k, v in part.tensors.items()},
        part.first_index + row,
        1,
    )


class HeldOut:
    """`evaluate(model)` -> the held-out metrics, the same on every rank (every rank must call it)."""

    def __init__(self, config, sigmas, spec, world, check_record, losses: Callable[..., Iterator], inference=None):
        """`sigmas`: held_out.sigmas; `check_record`: the trainer's shard check (its WindowMatch); `losses(model, part, draws)`: the run's loss
        path (train/step.py LossPath.losses), (loss, audio loss, count) per route of a one-row slice; `inference()`: a context every call runs in (the
        stages' pass under pipeline parallel), None for none."""
        from vt.train.parallel.order import OrderFromRankZero

        window = config.window
        self.sigmas = [float(s) for s in sigmas]
        self.seed = config.train.seed
        self.spec, self.world, self.losses = spec, world, losses
        self.inference = inference or contextlib.nullcontext
        low, high = spec.sigma_range()  # one expert of several: its own part of the noise levels
        self.levels = [low + (high - low) * s for s in self.sigmas]
        self.window = open_reader(eval_window_uri(window.uri), "keep", window.poll_seconds, window.timeout_seconds)
        self.reader = BatchReader(
            self.window,
            2**62,
            check_record=check_record,
            on_read=lambda position: None,
            order=OrderFromRankZero(self.window, world),
            dp_rank=world.dp_rank,
            dp_size=world.dims.dp,
            seed=config.train.seed,
        )
        self.batches: list[tuple[Batch, int]] | None = None  # (bucket's batch, its first sample's index)
        self.samples = 0

    def _load(self) -> None:
        registered = self.world.broadcast_object(self.window.world_size() if self.world.is_main else None)
        if registered is None:  # never encoded: no producer registered there
            raise UserError(
                f"data.eval is set but {self.window.uri} holds no held-out shards: run vt-precompute run "
                "with this config (it encodes data.eval first), or unset data.eval"
            )
        self.batches, offset = [], 0
        for batch in self.reader:  # one batch per bucket: the whole eval set, this rank's rows of it
            self.batches.append((batch, offset))
            offset += len(batch)
        self.samples = offset
        if not offset:
            raise RuntimeError(
                f"the held-out window {self.window.uri} holds no samples: did vt-precompute run with "
                "data.eval set? See its eval/precompute_report.json"
            )

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        if self.batches is None:
            self._load()
        levels = self.spec.noise_levels
        independent = self.spec.audio_timesteps == "independent"
        table = torch.zeros(self.samples, len(self.sigmas), dtype=torch.float64, device=self.world.comm_device)
        for batch, offset in self.batches:
            part = take_slice(batch, self.world.dp_rank, self.world.dims.dp, offset)
            rounds = -(-len(batch) // self.world.dims.dp)  # every rank runs as many calls: stand-ins pad
            for k in range(rounds):
                row = min(k, part.tensors["latents"].shape[0] - 1)
                sample = one_row(part, row)
                draws_at = fixed_draws(
                    sample, self.levels, self.seed, levels(sample.tensors["latents"].shape[1:]), independent
                )
                for j, draws in enumerate(draws_at):
                    with self.inference():
                        total = sum(loss.double() * count for loss, _, count in self.losses(model, sample, draws))
                    if k < part.count:
                        table[part.first_index + row, j] = total.to(table.device)
        table = self.world.sum(table)  # each entry from the one rank that holds its sample, zeros elsewhere
        means = table.cpu().mean(dim=0)
        out = {"eval_loss": float(means.mean())}
        out.update({f"eval_loss/sigma_{sigma:g}": float(value) for sigma, value in zip(self.sigmas, means)})
        return out


class HeldOutPart(Part):
    """data.eval: the held-out loss every `held_out.every` optimizer steps and at the end, with the weights each other
    part gives for it (`weights_for("held_out")`: the EMA's average with ema.eval)."""

    section = "held_out"

    @classmethod
    def wanted(cls, config) -> bool:
        return bool(config.data.eval) or bool(config.held_out.every)

    def check(self, spec, world_size: int) -> None:
        if self.settings.every and not self.config.data.eval:
            raise UserError(
                f"held_out.every = {self.settings.every} computes the held-out loss over data.eval, which is not "
                "set: set data.eval to held-out raw data (a folder, tar or manifest that data.raw does not "
                "hold), or remove held_out.every"
            )
        if any(not 0 < sigma <= 1 for sigma in self.settings.sigmas):
            raise UserError(f"held_out.sigmas = {self.settings.sigmas}: each must be in (0, 1]")

    def start(self, run: RunContext) -> None:
        self.run, self.held_out, self.evaluated = run, None, -1
        self.records: dict[int, dict] = {}  # step -> its logged training and held-out loss (the gap's)

    def evaluate(self, model, step: int) -> dict[str, float]:
        """The held-out metrics of `model` as it is now (every rank calls it)."""
        if self.held_out is None:  # the loss path exists once the trainer has its parts started
            run = self.run
            self.held_out = HeldOut(
                self.config,
                self.settings.sigmas,
                run.spec,
                run.world,
                run.shards_check,
                run.loss_path.losses,
                inference=run.staged,
            )
        self.evaluated = step
        with self.run.parts.weights_for("held_out"):
            return self.held_out.evaluate(model)

    def step_metrics(self, model, step: int) -> dict:
        every = self.settings.every
        return self.evaluate(model, step) if every and step % every == 0 else {}

    def final_metrics(self, model, step: int) -> dict:
        return self.evaluate(model, step) if 0 < step != self.evaluated else {}

    def logged(self, step: int, record: dict) -> None:
        """Warn when the gap between the held-out and the training loss widens (train/loss_gap.py), on rank 0."""
        self.records[step] = {key: record[key] for key in ("step", "loss", "eval_loss") if key in record}
        self.records[step]["step"] = step
        if "eval_loss" not in record or not self.run.world.is_main:
            return
        message = widening(gaps([self.records[s] for s in sorted(self.records)]))
        evaluations = sorted(s for s, r in self.records.items() if "eval_loss" in r)
        if len(evaluations) > WINDOW + 1:  # what the next judgement reads: the last WINDOW gaps and their spans
            self.records = {s: r for s, r in self.records.items() if s >= evaluations[-WINDOW - 1]}
        if message:
            log.warning("step %d: %s", step, message)
