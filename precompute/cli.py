"""`vt-precompute`: stage 1 as a command-line service, and `inspect` to look into a window."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from vt.shared.cli import SET_HELP, USER_ERRORS, fail, load_or_exit
from vt.shared.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Stage 1: stream raw video shards into a rolling window of latent shards.",
)


@app.callback()
def main() -> None:
    """vt precompute service."""


@app.command()
def run(
    config: Path = typer.Argument(..., help="TOML run config, e.g. configs/demo.toml"),
    set: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Encode raw webdataset shards (local or s3://) into latent shards in the window.

    Start as many as you like, by any launcher (torchrun, a Slurm array, by hand), at any time: they share
    the window's lanes (precompute.lanes) by claiming them. Killed and started again, or replaced by
    another producer, the work carries on where it stopped.
    """
    cfg = load_or_exit(config, set)
    from vt.precompute.processors import ProcessorBug
    from vt.precompute.service import run_stage1

    stop_on_sigterm()
    try:
        run_stage1(cfg)  # logs its summary line (every producer its own), once per data set
    except (*USER_ERRORS, ProcessorBug) as err:  # ProcessorBug: its traceback is logged above
        raise fail(str(err)) from err


def stop_on_sigterm() -> None:
    """SIGTERM (scancel, a time limit, Kubernetes) ends the run as an exception does: its lanes are released for
    other producers to take at once, and its report written."""
    import signal

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


@app.command()
def prompts(
    config: Path = typer.Argument(..., help="TOML run config, e.g. configs/demo.toml"),
    set: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Encode the config's validation prompts (and i2v images) into its window, for the trainer.

    Loads only the text (and image) encoders. vt-precompute run does this too; use this command for
    prompts added after the window was made.
    """
    cfg = load_or_exit(config, set)
    from vt.precompute.validation_conditions import encode_validation_inputs

    try:
        written = encode_validation_inputs(cfg)
    except USER_ERRORS as err:
        raise fail(str(err)) from err
    typer.echo(f"validation conditions: {written} inputs encoded into {cfg.window.uri}")


@app.command()
def caption(
    config: Path = typer.Argument(..., help="TOML run config whose precompute.processors has a caption_model"),
    set: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Caption data.raw's clips with the config's caption_model and write each as a .json sidecar beside its clip,
    to read and edit before `run` (which then takes the sidecars' captions). Encodes nothing."""
    cfg = load_or_exit(config, set)
    from vt.precompute.caption_review import write_caption_sidecars

    try:
        done = write_caption_sidecars(cfg)
    except (*USER_ERRORS, OSError) as err:
        raise fail(str(err)) from err
    rejected = ", ".join(f"{reason} {count}" for reason, count in sorted(done.rejected.items())) or "none"
    typer.echo(
        f"captions: {len(done.written)} sidecars written beside the clips of {cfg.data.raw}; skipped: {rejected}"
    )


@app.command()
def pack(
    folder: str = typer.Argument(..., help="folder (local or s3://) of clips and images with .txt/.json captions"),
    out: str = typer.Argument(..., help="where the tars go: a folder or s3://bucket/prefix"),
    shard_size: str = typer.Option("1GB", "--shard-size", help="close a tar once it holds this much, e.g. 512MB"),
    prefix: str = typer.Option("raw", "--prefix", help="tar names: <prefix>-000000.tar, ..."),
) -> None:
    """Write a folder of media files as webdataset tars of about --shard-size each (for object storage)."""
    from vt.precompute.pack import pack_folder, parse_size

    try:
        written = pack_folder(folder, out, parse_size(shard_size), prefix)
    except (*USER_ERRORS, OSError) as err:
        raise fail(str(err)) from err
    for url in written:
        typer.echo(url)


@app.command()
def inspect(
    window: str = typer.Argument(..., help="window URI: a folder or s3://bucket/prefix"),
    as_json: bool = typer.Option(False, "--json", help="print the state as JSON"),
) -> None:
    """Print a window's state: producers, committed, consumed watermark, evicted, bytes, buckets, fingerprint."""
    from vt.shared.storage import Storage
    from vt.shared.window import inspect

    try:
        if not Storage(window).list(""):
            raise fail(f"{window} holds no window (nothing there); give the window.uri of a run")
        state = inspect(window)
    except (UserError, OSError) as err:
        raise fail(f"cannot read the window {window}: {err}") from err
    typer.echo(json.dumps(state, indent=1) if as_json else format_state(state))


@app.command()
def status(
    window: str = typer.Argument(..., help="window URI: a folder or s3://bucket/prefix"),
    as_json: bool = typer.Option(False, "--json", help="print the status as JSON"),
) -> None:
    """Print how far stage 1 is: raw shards complete / being worked / waiting, each lane's holder, each
    producer's lanes, samples committed and rate, and the rejects by reason."""
    from vt.precompute.status import format_status, window_status
    from vt.shared.storage import Storage

    try:
        storage = Storage(window)
        if not storage.list(""):
            raise fail(f"{window} holds no window (nothing there); give the window.uri of a run")
        found = window_status(storage)
    except (UserError, OSError) as err:
        raise fail(f"cannot read the window {window}: {err}") from err
    typer.echo(json.dumps(found, indent=1) if as_json else format_status(found))


def format_state(state: dict) -> str:
    """The window state as a short human-readable table."""
    lines = [
        f"window {state['uri']}  size={state['size']}  producers={state['world_size']}",
        f"committed {state['committed']} shards, present {state['present']}, unread {state['unread']}, "
        f"evicted {state['evicted']}; {state['bytes'] / 1e6:.2f} MB",
        f"consumer: read position {state['read']}, watermark position {state['watermark']}",
        "producer  gen  done  committed  read  watermark  fingerprint",
    ]
    for rank, p in state["producers"].items():
        lines.append(
            f"p{rank:<8} {p['generation'] or '-':>3}  {'yes' if p['done'] else 'no':>4}  "
            f"{p['committed']:>9}  {p['read']:>4}  {p['watermark']:>9}  {p['fingerprint'] or '-'}"
        )
    lines.append("bucket      shards  samples")
    for bucket, counts in state["buckets"].items():
        lines.append(f"{bucket:<11} {counts['shards']:>6}  {counts['samples']:>7}")
    lines.append(f"shard fingerprints: {', '.join(state['fingerprints']) or '-'}")
    if state["orphans"]:
        lines.append(f"orphan data files (uncommitted or left by a crash): {len(state['orphans'])}")
    if state["leftovers"]:
        lines.append(
            f"unfinished writes (temp files or S3 uploads; a killed writer's are cleaned by its role's "
            f"next start): {len(state['leftovers'])}"
        )
        lines += [f"  {rel}  {age}s old" for rel, age in state["leftovers"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    app()
