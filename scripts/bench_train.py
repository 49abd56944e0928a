"""Training speed: vt's trainer against a bare PyTorch loop (scripts/bench_bare.py) on the same work.

Step time: one process holds a real `vt.train.trainer.Trainer` and a `BareLoop`, both on a copy of
the same transformer with the same LoRA init, fed the same batches, read once from the demo window
by the trainer's own reader. A first, untimed round has the bare loop replay the sigmas and noise
the trainer drew, so from equal weights their losses must agree step for step: the parity row
checks they do the same work. Then rounds alternate which side goes first; each side's round time
is the mean over the batches, and the row is the ratio of the medians.

The demo's tiny transformer steps in a few ms, which would mostly time Python; the bench builds a
wider LTX transformer (default 8 heads x 64 = 512 wide, 4 layers, ~20M parameters) with the tiny
preset's input and caption sizes, so the demo window's latents and text embeddings fit it as is.

Launch: `vt-train run` as a process, from its start to the time its first metrics.jsonl line was
written (the end of step 1), against `bench_bare.py` as a process doing start-up, load and the
same steps on the window's shard files. The same processes give the whole loop's steady step time
(window reads, batching and logging included): the median interval between step ends from step 3.
Process pairs run seconds apart, so these rows see more of a shared machine's load bursts than the
in-process step rounds do; they carry no goal.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import time
from itertools import islice
from pathlib import Path

import torch
from bench_bare import BareLoop, BareSettings
from bench_common import BIN, Row, median, run_timed, toml_string, write_run_config

from vt.shared.models.frame_conditions import task_of
from vt.shared.runtime import MMAP_THRESHOLD


def make_bench_transformer(model: Path, out: Path, heads: int, head_dim: int, layers: int, seed: int = 0) -> Path:
    """A wider LTX transformer with the tiny preset's latent and caption sizes, in diffusers layout."""
    from diffusers import LTXVideoTransformer3DModel

    tiny = LTXVideoTransformer3DModel.load_config(str(model), subfolder="transformer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = LTXVideoTransformer3DModel(
            in_channels=tiny["in_channels"],
            out_channels=tiny["out_channels"],
            patch_size=tiny["patch_size"],
            patch_size_t=tiny["patch_size_t"],
            caption_channels=tiny["caption_channels"],
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            cross_attention_dim=heads * head_dim,
            num_layers=layers,
        )
    transformer.save_pretrained(out, safe_serialization=True)
    return out


def train_overrides(model: Path, transformer: Path, window: Path, run_dir: Path) -> list[str]:
    """The demo config on the bench transformer and the precomputed (kept) window; no validation; the bare loop's
    sigmas (logit-normal, unshifted) in place of the family's reference recipe (LTX-Video's shift is "auto")."""
    return [
        'flow.sigma_sampling="logit_normal"',
        "flow.shift=1.0",
        f"model.path={toml_string(model)}",
        f"model.components.transformer={toml_string(transformer)}",
        f"run.dir={toml_string(run_dir)}",
        f"window.uri={toml_string(window)}",
        'window.size="keep"',
        "validation.prompts=[]",
        "train.checkpoint_every=0",
        "validation.every=0",
        "log.progress=false",
    ]


def bare_settings(trainer) -> BareSettings:
    """The bare loop's settings, taken from the trainer so both sides agree by construction."""
    config = trainer.config
    train, model, flow = config.train, config.model, trainer.loss_path.flow
    lora = trainer.parts["adapter"].build_options(trainer.spec, trains=True)["lora"]
    unsupported = {
        "model.family": model.family != "ltx-video",
        "model.task": task_of(model) != "t2v",
        "train.mode": train.mode != "lora",
        "train.grad_accum": train.grad_accum != 1,
        "flow.sigma_sampling": flow.sigma_sampling != "logit_normal",
        "flow.shift": flow.shift != 1.0,
        "lr_schedule": not trainer.parts["lr_schedule"].constant(),
    }
    bad = [key for key, differs in unsupported.items() if differs]
    if bad:
        raise ValueError(
            f"the bare baseline only implements LTX t2v LoRA, grad_accum 1, logit-normal sigmas, no "
            f"shift or warm-up; this config sets {', '.join(bad)}. Bench with configs/demo.toml"
        )
    g = trainer.spec.geometry
    return BareSettings(
        seed=train.seed,
        lora_rank=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_targets=list(lora["targets"] or trainer.spec.default_lora_targets),
        lr=train.lr,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm or float("inf"),
        rope_scale=(g.temporal / trainer.spec.frame_rate, float(g.spatial), float(g.spatial)),
        device=str(trainer.device),
        amp_dtype=trainer.amp_dtype,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DrawRecorder:
    """Wraps the trainer's `spec.forward` (the Model Spec API) to keep the sigmas and noise it is given.

    The parity round replays those draws in the bare loop, so the check needs nothing of how the
    trainer seeds its draws; the timing rounds run without the wrapper.
    """

    def __init__(self, spec):
        self.spec = spec
        self.draws: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._forward = spec.forward

    def __enter__(self) -> "DrawRecorder":
        def forward(transformer, batch, sigmas, noise, **kwargs):
            self.draws.append((sigmas.detach().cpu().clone(), noise.detach().cpu().clone()))
            return self._forward(transformer, batch, sigmas, noise, **kwargs)

        self.spec.forward = forward  # an instance attribute shadows the class method
        return self

    def __exit__(self, *exc) -> None:
        del self.spec.forward


def bench_steps(
    base_config: Path, model: Path, transformer: Path, window: Path, work: Path, rounds: int, steps: int
) -> dict:
    """A parity round, then alternating timed rounds of `steps` optimizer steps per side."""
    from vt.shared.config import load_config
    from vt.train.trainer import Trainer

    config = load_config(
        base_config, train_overrides(model, transformer, window, work / "train-steps") + ["train.epochs=1000"]
    )  # a kept window re-read as often as `steps` needs
    trainer = Trainer(config)
    batches = list(islice(iter(trainer.reader), steps))
    if not batches:
        raise RuntimeError(f"the window {window} gave no batches; run the precompute bench first")
    bare = BareLoop(transformer, bare_settings(trainer))
    bare.copy_trainable(trainer.transformer)  # vt draws each adapter from a generator keyed by its name
    device = trainer.device

    def vt_step(batch) -> float:
        loss = trainer.train_step([batch])["loss"]
        trainer.step += 1
        return float(loss)

    # Round 0, untimed (it also warms both sides up): the bare loop replays the trainer's own draws
    # on the same batches from the same weights, so the losses must agree step for step.
    parity_losses: dict[str, list[float]] = {"vt": [], "bare": []}
    for batch in batches:
        with DrawRecorder(trainer.spec) as recorder:
            parity_losses["vt"].append(vt_step(batch))
        if len(recorder.draws) != 1:
            raise RuntimeError(
                f"the trainer called spec.forward {len(recorder.draws)} times in one step; the "
                "bench expects one (train.grad_accum = 1, one process)"
            )
        sigmas, noise = recorder.draws[0]
        parity_losses["bare"].append(bare.step(batch.tensors, sigmas, noise))
    parity = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(parity_losses["vt"], parity_losses["bare"]))

    sides = {"vt": vt_step, "bare": lambda b: bare.step(b.tensors)}
    times: dict[str, list[float]] = {"vt": [], "bare": []}
    for round_index in range(rounds):
        for side in ("vt", "bare") if round_index % 2 == 0 else ("bare", "vt"):
            gc.collect()
            _sync(device)
            started = time.perf_counter()
            for batch in batches:
                sides[side](batch)
            _sync(device)
            times[side].append((time.perf_counter() - started) / len(batches))
    trainer.tracker.close()
    vt_ms, bare_ms = median(times["vt"]) * 1e3, median(times["bare"]) * 1e3
    paired = median([a / b for a, b in zip(times["vt"], times["bare"])])  # each round's two sides ran back to back
    width = trainer.transformer.config.num_attention_heads * trainer.transformer.config.attention_head_dim
    shapes = sorted({b.bucket for b in batches})
    rows = [
        Row(
            "train step: Trainer.train_step vs bare loop",
            vt_ms,
            "ms",
            baseline=bare_ms,
            max_ratio=1.03,
            note=f"median of {rounds} alternating rounds x {len(batches)} steps (median paired ratio {paired:.3f}); "
            f"LTX {width} wide, "
            f"{trainer.transformer.config.num_layers} layers, batch {config.train.batch_size}, buckets {shapes}",
        ),
        Row(
            "  loss parity vt vs bare (max relative diff)",
            parity,
            "",
            max_value=1e-4,
            note=f"{len(batches)} steps, the bare loop replaying the trainer's sigmas and noise",
        ),
    ]
    return {
        "rows": rows,
        "vt_ms": vt_ms,
        "bare_ms": bare_ms,
        "paired_ratio": paired,
        "round_times_s": times,
        "parity_losses": parity_losses,
        "parity": parity,
        "batches": len(batches),
        "buckets": shapes,
        "batch_size": config.train.batch_size,
    }


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _launch_times(started: float, stamps: list[float]) -> dict:
    """First step from process start; steady step: the median interval between step ends from step 3
    on (steps 1-2 still pay first calls; the median shrugs off a step slowed by a neighbour's burst)."""
    intervals = [b - a for a, b in zip(stamps[2:], stamps[3:])]
    return {"first_step_s": stamps[0] - started, "steady_step_s": median(intervals) if intervals else float("nan")}


# The malloc policy of each side (glibc's mmap threshold, bytes): vt's processes map allocations above 64 KiB
# (runtime.map_large_allocations: host memory at real size); the bare loop runs under the same policy, so the
# steady-step row compares what its name says, and a third side, vt under glibc's default policy, shows what
# the policy costs on a CPU.
SAME_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
GLIBC_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)}  # glibc's dynamic threshold's ceiling on 64-bit


def launch_vt(
    base_config: Path,
    model: Path,
    transformer: Path,
    window: Path,
    work: Path,
    name: str,
    max_steps: int,
    threads: int,
    env: dict[str, str] | None = None,
) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no checkpoint to resume, no old metrics
    config = write_run_config(
        base_config,
        work / f"{name}.toml",
        train_overrides(model, transformer, window, run_dir) + [f"train.max_steps={max_steps}", "train.epochs=1000"],
    )
    started, seconds, _ = run_timed([str(BIN / "vt-train"), "run", str(config)], work / f"{name}.log", threads, env=env)
    metrics = _metrics(run_dir)
    if len(metrics) != max_steps:
        raise RuntimeError(f"vt-train logged {len(metrics)} steps, expected {max_steps}; see {work / name}.log")
    return {
        **_launch_times(started, [m["time"] for m in metrics]),
        "process_s": seconds,
        "data_wait_ms": [round(m.get("data_wait_s", 0.0) * 1e3, 2) for m in metrics],
    }


def launch_bare(
    transformer: Path, window: Path, work: Path, name: str, max_steps: int, batch_size: int, threads: int
) -> dict:
    args = [
        sys.executable,
        str(Path(__file__).with_name("bench_bare.py")),
        "--transformer",
        str(transformer),
        "--window",
        str(window),
        "--batch-size",
        str(batch_size),
        "--steps",
        str(max_steps),
        "--threads",
        str(threads),
    ]
    started, seconds, out = run_timed(args, work / f"{name}.log", threads, env=SAME_MALLOC)
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {**_launch_times(started, result["step_done"]), "process_s": seconds}


def bench_launch(
    base_config: Path,
    model: Path,
    transformer: Path,
    window: Path,
    work: Path,
    rounds: int,
    max_steps: int,
    threads: int,
    batch_size: int,
) -> dict:
    """Alternating vt-train / bare / vt-train under glibc's malloc policy, processes of `max_steps` steps:
    launch -> first step, and steady steps (the order rotates each round)."""
    sides = ("vt", "bare", "vt_glibc")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for index in range(rounds):
        for side in sides[index % 3 :] + sides[: index % 3]:
            name = f"launch-{side}-{index}"
            if side == "bare":
                runs[side].append(launch_bare(transformer, window, work, name, max_steps, batch_size, threads))
            else:
                runs[side].append(
                    launch_vt(
                        base_config,
                        model,
                        transformer,
                        window,
                        work,
                        name,
                        max_steps,
                        threads,
                        env=GLIBC_MALLOC if side == "vt_glibc" else None,
                    )
                )
    first = {side: median([r["first_step_s"] for r in runs[side]]) for side in runs}
    steady = {side: median([r["steady_step_s"] for r in runs[side]]) * 1e3 for side in runs}
    rows = [
        Row(
            "launch -> first step: vt-train run vs bare script",
            first["vt"],
            "s",
            baseline=first["bare"],
            note=f"median of {rounds} alternating process pairs",
        ),
        Row(
            "  Trainer.run steady step (data + logging) vs bare",
            steady["vt"],
            "ms",
            baseline=steady["bare"],
            max_ratio=1.02,
            note=f"the same processes: median interval between step ends, steps 3..{max_steps}; "
            "both under vt's malloc policy (64 KiB mmap threshold)",
        ),
        Row(
            "  vt-train steady step: vt's malloc policy vs glibc's default",
            steady["vt"],
            "ms",
            baseline=steady["vt_glibc"],
            note="what mapping allocations above 64 KiB (host memory at real size) "
            "costs a CPU-bound step; MALLOC_MMAP_THRESHOLD_ overrides it",
        ),
    ]
    return {"rows": rows, "vt_runs": runs["vt"], "bare_runs": runs["bare"], "vt_glibc_runs": runs["vt_glibc"]}
