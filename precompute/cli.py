"""`vt-precompute`: stage 1 as a command-line service."""

from __future__ import annotations

from pathlib import Path

import typer

from vt.shared.cli import SET_HELP, dist_env, fail, load_or_exit

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Stage 1: stream raw video shards into a rolling window of latent shards.")


@app.callback()
def main() -> None:
    """vt precompute service."""


@app.command()
def run(config: Path = typer.Argument(..., help="TOML run config, e.g. configs/demo.toml"),
        set: list[str] = typer.Option([], "--set", help=SET_HELP)) -> None:
    """Encode raw webdataset shards (local or s3://) into latent shards in the window."""
    cfg = load_or_exit(config, set)
    from vt.precompute.service import Precompute, TooManyFailures

    rank, world_size = dist_env()
    try:
        report = Precompute(cfg, rank, world_size).run()
    except (TooManyFailures, FileNotFoundError, ValueError) as err:
        raise fail(str(err)) from err
    typer.echo(report.summary_line())


if __name__ == "__main__":
    app()
