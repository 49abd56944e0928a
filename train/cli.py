"""`vt-train`: stage 2 from the command line (also `python -m vt.train` under torchrun)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import typer

from vt.shared.cli import SET_HELP, USER_ERRORS, fail, load_or_exit

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Stage 2: train on the latent shards of a window.",
)


@app.callback()
def main() -> None:
    """vt trainer."""


@app.command()
def run(
    config: Path = typer.Argument(..., help="TOML run config, e.g. configs/demo.toml"),
    set: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Train (LoRA or full) on the window named by the config; resumes from the newest checkpoint."""
    cfg = load_or_exit(config, set)
    _note_accelerate_cpu()
    from vt.train.trainer import Trainer

    try:
        Trainer(cfg).run()  # rank 0 logs the summary line ("done: ..."), printed once, not once per rank
    except USER_ERRORS as err:
        raise fail(str(err)) from err
    # The trainer's model, optimizer and mesh form reference cycles holding gloo work objects: free them now,
    # not at interpreter exit, where freeing their tensors aborts the process ("terminate called ...").
    gc.collect()


def _note_accelerate_cpu() -> None:
    """`accelerate launch --cpu --num_processes N` starts ONE process (accelerate's several-CPU-process
    mode goes through MPI): say how to get N ranks instead of training quietly on one."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" and "WORLD_SIZE" not in os.environ:
        from vt.shared.log import get_logger

        get_logger("vt.train").warning(
            "started by `accelerate launch --cpu`, which runs a single process: for N ranks use "
            "`accelerate launch --multi_gpu --num_processes N -m vt.train run ...` (it starts them as torchrun "
            "does, on CPUs too) or torchrun --nproc-per-node N"
        )


@app.command()
def plan(
    config: Path = typer.Argument(..., help="TOML run config, e.g. configs/demo.toml"),
    gpus: int = typer.Option(1, "--gpus", min=1, help="ranks (GPUs) the run would use"),
    gpu_memory: float = typer.Option(
        0.0, "--gpu-memory", min=0.0, help="GiB per GPU, e.g. 80: says whether it fits and what would"
    ),
    device: str = typer.Option("cuda", "--device", help="cuda (GPU memory), or cpu (a CPU run's host memory)"),
    host_memory: float = typer.Option(
        0.0, "--host-memory", min=0.0, help="GiB of host memory per rank, e.g. 64: what fits must fit it too"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    set: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Memory per rank (start-up, weights, gradients, optimizer, activations per bucket, validation, host memory,
    stage-1 encoders) from the components' config files alone: no weights are loaded. With --gpu-memory, the
    settings (alone and in pairs) that would fit, quickest first."""
    import json

    cfg = load_or_exit(config, set)
    from vt.train.plan import format_plan, make_plan, plan_json
    from vt.train.plan_search import alternatives, format_fits

    if device not in ("cuda", "cpu"):
        raise fail(f"--device must be cuda or cpu, got {device!r}")
    host = host_memory or None
    try:
        cfg, picked = auto_layout_for_plan(cfg, gpus, device, gpu_memory)
        budget = int(gpu_memory * 2**30) if gpu_memory else None  # "auto" VAE tiling decides against it
        result = make_plan(cfg, gpus, device, budget=budget)
        fitting = (
            alternatives(cfg, gpus, device, budget, None if host is None else int(host * 2**30))
            if gpu_memory and not as_json
            else []
        )
    except USER_ERRORS as err:
        raise fail(str(err)) from err
    if as_json:
        typer.echo(json.dumps(plan_json(result), indent=1))
        return
    if picked:
        typer.echo(picked)
    lines = [format_plan(result, gpu_memory, host)]
    if gpu_memory:
        lines += format_fits(result, fitting, gpu_memory, host)
    typer.echo("\n".join(lines))


def auto_layout_for_plan(cfg, gpus: int, device: str, gpu_memory: float):
    """`parallel.dp_shard = "auto"` as the trainer would resolve it with `gpu_memory` GiB per rank: the config with
    the picked degrees and the line saying why; without --gpu-memory (or with nothing to choose) the sharded
    layout, as -1."""
    from vt.train.parallel.layout import GIB, choose, unplanned_reason
    from vt.train.plan import make_plan

    parallel = cfg.parallel
    if parallel.dp_shard != "auto" or unplanned_reason(parallel, gpus) is not None:
        return cfg, ""
    if not gpu_memory:
        return cfg, "parallel.dp_shard = auto: planned sharded (FSDP2); --gpu-memory GiB shows what auto picks"
    data_parallel = gpus // (parallel.cp * parallel.tp)

    def with_degrees(dp_replicate: int, dp_shard: int):
        return cfg.model_copy(
            update={"parallel": parallel.model_copy(update={"dp_replicate": dp_replicate, "dp_shard": dp_shard})}
        )

    peaks = [
        make_plan(with_degrees(*degrees), gpus, device, budget=int(gpu_memory * GIB)).rank.device_total
        for degrees in ((data_parallel, 1), (1, data_parallel))
    ]
    choice = choose(*peaks, int(gpu_memory * GIB), data_parallel)
    return with_degrees(choice.dp_replicate, choice.dp_shard), choice.reason


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="a run's run.dir, e.g. runs/demo (finished or running)"),
    out: Path = typer.Option(None, "--out", help="where to write the page (default RUN_DIR/report.html)"),
) -> None:
    """Rebuild RUN_DIR/report.html from the run's files: curves, validation videos, window, precompute, config."""
    from vt.train.report import write_report

    try:
        path = write_report(run_dir, out)
    except (*USER_ERRORS, OSError) as err:
        raise fail(str(err)) from err
    typer.echo(f"report: {path}")


@app.command()
def compare(
    run_dirs: list[Path] = typer.Argument(..., help="the run.dir of each run, e.g. runs/a runs/b"),
    out: Path = typer.Option(None, "--out", help="where to write the page (default ./compare.html)"),
) -> None:
    """One page with runs side by side: their loss, held-out loss and video metric curves, and their validation
    videos at the steps every run validated."""
    from vt.train.compare import write_compare

    try:
        path = write_compare(run_dirs, out)
    except (*USER_ERRORS, OSError) as err:
        raise fail(str(err)) from err
    typer.echo(f"compare: {path}")


@app.command()
def env() -> None:
    """Versions, GPUs, attention backends and fp8 recipes of this machine: paste it into a bug report."""
    from vt.train.env import environment, format_environment

    typer.echo(format_environment(environment()))


if __name__ == "__main__":
    app()
