"""Metrics sinks: a JSONL file that is always written, plus optional wandb and TensorBoard.

The trainer calls `Tracker.log(step, metrics)` every step; the tracker decides whether the step is
due (every N steps or every T seconds, whichever comes first), so the loop carries no logging logic.
The JSONL file is the source of truth: it is flushed per line so a crash keeps everything logged
up to it, it survives a resume (appended, a torn tail from a crash is cut first), and `plot_loss`
and tests read it without any tracking service installed.
"""

from __future__ import annotations

import json
import numbers
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from vt.shared.errors import UserError

METRICS_FILE = "metrics.jsonl"
RESERVED_KEYS = ("step", "time")


class Tracker:
    """Fans metrics out to the JSONL file, wandb and TensorBoard, rate-limited by steps or seconds.

    Only rank 0 should log: other ranks pass `enabled=False` and every call does nothing.
    `every_steps=0` logs by time only; `every_seconds=0` logs by steps only.
    """

    def __init__(
        self,
        run_dir: Path,
        every_steps: int = 1,
        every_seconds: float = 0.0,
        wandb: bool = False,
        tensorboard: bool = False,
        config: dict | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        if every_steps < 0 or every_seconds < 0:
            raise UserError(
                f"log.every_steps ({every_steps}) and log.every_seconds ({every_seconds}) must not be negative"
            )
        if every_steps == 0 and every_seconds == 0:
            raise UserError(
                "log.every_steps and log.every_seconds are both 0, so nothing would ever be "
                "logged: set log.every_steps=1 (every step) or log.every_seconds > 0"
            )
        self.run_dir = Path(run_dir)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.enabled = enabled
        self._clock = clock
        self._last_time = clock()
        self._file = None
        self._wandb_run = None
        self._tb_writer = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        _cut_torn_tail(self.metrics_path)
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        try:
            if tensorboard:
                self._tb_writer = _open_tensorboard(self.run_dir / "tensorboard", config)
            if wandb:
                self._wandb_run = _open_wandb(self.run_dir, config)
        except BaseException:
            self.close()
            raise

    def due(self, step: int) -> bool:
        """True when `step` is a multiple of every_steps or every_seconds passed since the last log."""
        if not self.enabled:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and self._clock() - self._last_time >= self.every_seconds

    def log(self, step: int, metrics: dict[str, float], force: bool = False) -> bool:
        """Write `metrics` for `step` to every sink if due (or forced); returns whether it logged."""
        if not self.enabled or not (force or self.due(step)):
            return False
        values = self._write(step, metrics)
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        self._last_time = self._clock()
        return True

    def log_records(self, records: list[tuple[int, dict]]) -> None:
        """Records measured apart from their step's (a validation's video metrics, finished later), each under its
        own step. wandb takes no step below its current one, so there they carry it as `validation_step`, the x-axis
        `_open_wandb` defines for them."""
        for step, metrics in records if self.enabled else ():
            values = self._write(step, metrics)
            if self._wandb_run is not None:
                self._wandb_run.log({"validation_step": int(step), **values})

    def _write(self, step: int, metrics: dict) -> dict[str, float]:
        """`metrics` for `step` into the JSONL file and TensorBoard (both take any step); returns them as scalars."""
        values = {name: _scalar(name, value) for name, value in metrics.items()}
        record = {"step": int(step), "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb_writer is not None:
            for name, value in values.items():
                self._tb_writer.add_scalar(name, value, global_step=step)
            self._tb_writer.flush()
        return values

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict]:
    """Parse a metrics.jsonl file. A torn last line (a crash mid-write) is skipped; a broken line
    elsewhere means the file was edited or corrupted, and raises naming the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}: has the run logged anything yet?")
    lines = path.read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: torn by a crash
                break
            raise UserError(f"{path}:{number}: not a JSON line ({err}); fix or delete that line") from err
    return records


def _scalar(name: str, value: Any) -> float | int:
    """Numbers (and 1-element tensors/arrays) -> a Python number; anything else is a caller bug."""
    if name in RESERVED_KEYS:
        raise UserError(f"metric name {name!r} is reserved for the record itself; rename the metric")
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        if hasattr(value, "item"):
            value = value.item()
        else:
            raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}: {value!r}")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return float(value)  # NaN/inf are logged as is (json writes NaN/Infinity): they are the news


def _cut_torn_tail(path: Path) -> None:
    """A crash can leave a half-written last line; cut it so appended lines stay one per line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)


def _open_tensorboard(log_dir: Path, config: dict | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(
            "log.tensorboard=true needs the tensorboard package: pip install tensorboard "
            "(or pip install 'vt[tracking]'), or set log.tensorboard=false"
        ) from err
    writer = SummaryWriter(log_dir=str(log_dir))
    if config:
        writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
    return writer


def _open_wandb(run_dir: Path, config: dict | None):
    """Start (or resume) this run folder's wandb run. Without WANDB_API_KEY it runs offline, so a
    machine with no account or network still trains; `wandb sync` uploads it later."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            "log.wandb=true needs the wandb package: pip install wandb "
            "(or pip install 'vt[tracking]'), or set log.wandb=false"
        ) from err
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "vt"),
        name=run_dir.name,
        id=run_id,
        resume="allow",
        mode=mode,
        dir=os.environ.get("WANDB_DIR", str(run_dir)),
        config=config or {},
    )
    run.define_metric("validation_step")
    run.define_metric("val/*", step_metric="validation_step")  # (Tracker.log_records)
    return run
