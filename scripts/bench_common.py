"""What the benchmarks share: result rows, medians, the table, run configs and child processes.

A row compares vt with a baseline as a ratio of medians, next to a goal (`max_ratio`); rows without
a baseline or goal are context (seconds per stage) and never fail. Machines here are shared and
noisy, so the timing benches alternate the two sides round by round and quote medians.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass
class Row:
    name: str
    vt: float
    unit: str
    baseline: float | None = None
    max_ratio: float | None = None  # goal: vt / baseline at most this
    max_value: float | None = None  # goal for rows without a baseline: vt at most this
    note: str = ""
    min_ratio: float | None = None  # goal (with max_ratio): vt / baseline at least this, e.g. an estimate's band

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.vt / self.baseline

    @property
    def goal(self) -> str:
        if self.min_ratio is not None and self.max_ratio is not None:
            return f"{self.min_ratio:g}x..{self.max_ratio:g}x"
        if self.max_ratio is not None:
            return f"<= {self.max_ratio:g}x"
        if self.max_value is not None:
            return f"<= {self.max_value:g}"
        return "-"

    @property
    def ok(self) -> bool | None:
        if self.max_ratio is not None:
            low = self.min_ratio if self.min_ratio is not None else float("-inf")
            return self.ratio is not None and low <= self.ratio <= self.max_ratio
        if self.max_value is not None:
            return self.vt <= self.max_value
        return None

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "goal": self.goal, "ok": self.ok}


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("no measurements to take a median of")
    return statistics.median(values)


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B":
        return f"{value:,.0f} B"
    if not unit:  # a plain number, e.g. a relative difference
        return f"{value:.1e}"
    if abs(value) >= 100:
        return f"{value:.1f} {unit}"
    if abs(value) >= 0.01 or value == 0:
        return f"{value:.3f} {unit}"
    return f"{value:.2e} {unit}"


def format_table(rows: list[Row]) -> str:
    header = ("benchmark", "vt", "baseline", "ratio", "goal", "ok?")
    lines = [header]
    for row in rows:
        ok = {True: "ok", False: "FAIL", None: "-"}[row.ok]
        ratio = "-" if row.ratio is None else f"{row.ratio:.3f}x"
        lines.append((row.name, _number(row.vt, row.unit), _number(row.baseline, row.unit), ratio, row.goal, ok))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for index, line in enumerate(lines):
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells))
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def machine() -> dict:
    """Enough about the machine to read the numbers later: CPU, cores, load, library versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    return info


def child_env(threads: int) -> dict:
    """The environment of every child process: offline, and the same thread count on both sides."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def popen(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start `args` as a fresh process in ROOT, stdout and stderr to `log`: how the benches start their children.

    Each bench function that starts children takes a `launch` of this signature (default: this one); the tests
    pass one that forks them from a warm interpreter (tests/helpers/forkserver.py), since they check that the
    bench runs and prints its rows, not its numbers. A launch returns an object with Popen's poll, wait, kill
    and returncode."""
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def wait_or_kill(proc, timeout: float) -> int:
    """`proc`'s exit code; past `timeout` seconds it is killed (and reaped) and TimeoutExpired raised."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def run_timed(
    args: list[str],
    log: Path,
    threads: int,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    launch=popen,
) -> tuple[float, float, str]:
    """Run a child process (`env`: variables on top of `child_env`; `launch`: see popen); returns (wall-clock
    start, seconds it ran, its output). Fails loudly."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    clock = time.perf_counter()
    proc = launch(args, log, {**child_env(threads), **(env or {})})
    code = wait_or_kill(proc, timeout)
    seconds = time.perf_counter() - clock
    text = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(
            f"{' '.join(map(str, args[:3]))} ... exited with {code}; its output is in {log}:\n{text[-3000:]}"
        )
    return started, seconds, text


def write_run_config(base: Path, out: Path, overrides: list[str]) -> Path:
    """The base config (e.g. configs/demo.toml) with `--set`-style overrides, resolved into `out`."""
    from vt.shared.config import load_config, to_toml

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_toml(load_config(base, overrides)))
    return out


def toml_string(value: str) -> str:
    """A string as a TOML literal for an override, so paths are never parsed as numbers or dates."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def asset_arguments(parser, out: Path, out_help: str = "work folder") -> None:
    """The bench scripts' common arguments: the base config, the tiny preset and raw shards `make assets` builds,
    and the work folder (`out` by default)."""
    parser.add_argument("--config", type=Path, default=ROOT / "configs/demo.toml", help="base run config")
    parser.add_argument("--model", type=Path, default=ROOT / "runs/models/ltx-video-tiny", help="tiny LTX preset")
    parser.add_argument("--raw", type=Path, default=ROOT / "runs/data/raw", help="raw webdataset shards")
    parser.add_argument("--out", type=Path, default=out, help=out_help)
