"""What both CLIs share: loading the run config with `--set` overrides and turning errors into advice."""

from __future__ import annotations

from pathlib import Path

import typer

from vt.shared.config import Config, ConfigError, load_config
from vt.shared.errors import UserError
from vt.shared.log import apply_level

# What a CLI prints as one line (`fail`): the user's errors, and a path the user gave that is not there. Anything
# else is a bug and keeps its traceback.
USER_ERRORS = (UserError, FileNotFoundError)

SET_HELP = "Override a config key, e.g. --set window.size=8 (repeatable; value read as TOML)."


def load_or_exit(config: Path, overrides: list[str]) -> Config:
    try:
        loaded = load_config(config, overrides)
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(2) from err
    apply_level(loaded.log.level)  # before the CLI imports the model libraries: their bars and notices
    return loaded


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)
