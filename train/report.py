"""<run.dir>/report.html: one page a person opens to see a run, built from the run's own files.

The trainer rewrites it at its log interval (at most every `log.report_every_seconds`, on a thread of its own)
and at the end; `vt-train report RUN_DIR` rebuilds it from a finished or running run. It shows the training curves
(train/report_plots.py), the validation videos per step side by side with their prompts, the
window's state (as `vt-precompute inspect` reads it), the precompute reports and rejected samples by
reason, the resolved config and the `vt-train env` block. The page works opened as a file: plotly.js
is embedded and the videos are relative links to the run's mp4s, so nothing is fetched from a network.
"""

from __future__ import annotations

import html
import json
import os
import re
import threading
import time
import tomllib
from collections import defaultdict
from pathlib import Path

from vt.shared.log import get_logger
from vt.train.report_plots import curve_figures, loss_keys
from vt.train.trackers import read_metrics

__all__ = ["write_report", "ENV_FILE", "REPORT_FILE"]
log = get_logger("vt.train.report")
REPORT_FILE = "report.html"
ENV_FILE = "env.txt"  # the `vt-train env` block of the machine that trained (written once by the trainer)
KEYS_SHOWN = 50  # rejected keys listed per reason (all of them are in rejects.jsonl)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 0.5em; }
.step { display: flex; gap: 1em; flex-wrap: wrap; margin-bottom: 1em; }
figure { margin: 0; max-width: 360px; } video { width: 100%; background: #000; }
figcaption { font-size: 0.9em; } table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.2em 0.6em; text-align: right; } th { background: #f4f4f4; }
td:first-child, th:first-child { text-align: left; } pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; }
.muted { color: #777; }
"""


def _esc(value) -> str:
    return html.escape(str(value))


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _read_config(run_dir: Path) -> tuple[str, dict]:
    path = run_dir / "config.toml"
    if not path.is_file():
        return "", {}
    text = path.read_text()
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return text, {}


def _metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl by step: the records of a step merged, the later value of a key winning (a resumed run logs some
    steps twice; a validation's video metrics come in records of their own, logged later)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for record in read_metrics(path):
        if "step" in record:
            by_step.setdefault(record["step"], {}).update(record)
    return [by_step[step] for step in sorted(by_step)]


def _plots(records: list[dict]) -> str:
    import plotly.io as pio

    figures = curve_figures(records)
    if not figures:
        return "<p class='muted'>no training steps logged yet</p>"
    parts = [
        pio.to_html(
            fig,
            include_plotlyjs=index == 0,
            full_html=False,  # plotly.js once, inline
            config={"displaylogo": False, "responsive": True},
        )
        for index, fig in enumerate(figures)
    ]
    return "<div class='plots'>" + "".join(f"<div class='plot'>{part}</div>" for part in parts) + "</div>"


def _videos(run_dir: Path, page_dir: Path, prompts: list[str]) -> str:
    steps = sorted((p for p in (run_dir / "validation").glob("step-*") if p.is_dir()), key=lambda p: p.name)
    blocks = []
    for step in steps:
        cells = []
        for video in sorted(step.glob("*.mp4")):
            index = int(video.stem) if video.stem.isdigit() else None
            prompt = prompts[index] if index is not None and index < len(prompts) else video.stem
            src = Path(os.path.relpath(video, page_dir)).as_posix()
            cells.append(
                f"<figure><video src='{_esc(src)}' controls muted loop preload='auto'></video>"
                f"<figcaption>{_esc(prompt)}</figcaption></figure>"
            )
        if cells:
            number = re.sub(r"^step-0*(?=\d)", "", step.name)
            blocks.append(f"<h3>step {_esc(number)}</h3><div class='step'>{''.join(cells)}</div>")
    return "".join(blocks) or "<p class='muted'>no validation videos yet (validation.every, validation.prompts)</p>"


def _window(config: dict) -> str:
    from vt.shared.window import inspect

    uri = config.get("window", {}).get("uri")
    if not uri:
        return "<p class='muted'>the run's config names no window</p>"
    if "://" not in uri and not Path(uri).exists():
        return f"<p class='muted'>window {_esc(uri)} not found from {_esc(Path.cwd())}</p>"
    try:
        state = inspect(uri)
    except (OSError, ValueError, KeyError) as err:
        return f"<p class='muted'>cannot read the window {_esc(uri)}: {_esc(err)}</p>"
    totals = _table(
        ["lanes", "committed", "read", "watermark", "evicted", "present", "unread", "MB"],
        [
            [
                state["world_size"],
                state["committed"],
                state["read"],
                state["watermark"],
                state["evicted"],
                state["present"],
                state["unread"],
                f"{state['bytes'] / 1e6:.2f}",
            ]
        ],
    )
    producers = _table(
        ["lane", "generation", "done", "committed", "read", "unread", "watermark", "fingerprint"],
        [
            [
                f"p{rank}",
                p["generation"] or "-",
                "yes" if p["done"] else "no",
                p["committed"],
                p["read"],
                p["unread"],
                p["watermark"],
                p["fingerprint"] or "-",
            ]
            for rank, p in state["producers"].items()
        ],
    )
    buckets = _table(
        ["bucket", "shards", "samples"],
        [[bucket, counts["shards"], counts["samples"]] for bucket, counts in state["buckets"].items()],
    )
    return f"<p>{_esc(uri)}, size {_esc(state['size'])}</p>" + totals + producers + buckets


def _precompute(run_dir: Path) -> str:
    reports = sorted(run_dir.glob("precompute_report*.json"))
    if not reports:
        return "<p class='muted'>no precompute report in this run folder</p>"
    rows, stage_rows = [], []
    for path in reports:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being rewritten: the next rebuild reads it
        name = f"{report.get('producer', '-')} (lanes {','.join(map(str, report.get('lanes', []))) or '-'})"
        rows.append(
            [
                name,
                report.get("status"),
                report.get("seen"),
                report.get("committed"),
                report.get("rejected_total"),
                report.get("shards"),
                f"{report.get('bytes', 0) / 1e6:.2f}",
                report.get("elapsed_s"),
                report.get("samples_per_s"),
            ]
        )
        for stage, seconds in sorted(report.get("seconds", {}).items()):
            rate = report.get("committed", 0) / seconds if seconds else None
            stage_rows.append([name, stage, seconds, f"{rate:.2f}" if rate else "-"])
    out = _table(
        ["producer", "status", "seen", "committed", "rejected", "shards", "MB", "elapsed s", "samples/s"], rows
    )
    out += "<h3>seconds per stage</h3>" + _table(["producer", "stage", "seconds", "samples/s of the stage"], stage_rows)
    return out + _rejects(run_dir)


def _rejects(run_dir: Path) -> str:
    by_reason: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(run_dir.glob("rejects*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a running producer
            by_reason[entry.get("reason", "unknown")].append(entry)
    if not by_reason:
        return "<h3>rejected samples</h3><p>none</p>"
    parts = ["<h3>rejected samples</h3>"]
    for reason, entries in sorted(by_reason.items()):
        shown = entries[:KEYS_SHOWN]
        more = f" (first {KEYS_SHOWN} shown; all in rejects.jsonl)" if len(entries) > KEYS_SHOWN else ""
        parts.append(f"<h4>{_esc(reason)}: {len(entries)}{more}</h4>")
        parts.append(
            _table(["key", "shard", "detail"], [[e.get("key"), e.get("shard"), e.get("detail", "")] for e in shown])
        )
    return "".join(parts)


def _environment(run_dir: Path) -> str:
    path = run_dir / ENV_FILE
    if path.is_file():
        return f"<pre>{_esc(path.read_text())}</pre>"
    from vt.train.env import environment, format_environment

    return (
        "<p class='muted'>the run recorded no env.txt: this is the machine that built the page</p>"
        f"<pre>{_esc(format_environment(environment()))}</pre>"
    )


def _summary(run_dir: Path, records: list[dict], config: dict) -> str:
    model = config.get("model", {})
    finished = (run_dir / "memory.json").is_file()  # the trainer writes it in its last act
    last = records[-1] if records else {}
    losses = ", ".join(f"{key} {last[key]:.4f}" for key in loss_keys(records[-1:]) if key in last)
    memory = ""
    if finished:
        recorded = json.loads((run_dir / "memory.json").read_text())
        kind, peaks = (
            ("GPU", recorded["gpu_peak_gb"])
            if recorded.get("gpu_peak_gb")
            else ("host", recorded.get("host_peak_gb", []))
        )
        memory = f"; peak {kind} memory per rank " + ", ".join(f"{p:.2f} GiB" for p in peaks)
    return (
        f"<p>{_esc(model.get('family', '?'))} {_esc(config.get('train', {}).get('mode', ''))} from "
        f"{_esc(model.get('path', '?'))}: {'finished' if finished else 'running'}, "
        f"{last.get('step', 0)} steps logged{'; last ' + _esc(losses) if losses else ''}{_esc(memory)}. "
        f"<span class='muted'>Built {_esc(time.strftime('%Y-%m-%d %H:%M:%S'))}.</span></p>"
    )


def build_report(run_dir: Path, page_dir: Path | None = None) -> str:
    """The page's HTML for `run_dir`; video links relative to `page_dir` (default: the run folder)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder at {run_dir}: give the run.dir of a run (e.g. runs/demo)")
    config_text, config = _read_config(run_dir)
    records = _metrics(run_dir)
    prompts = config.get("validation", {}).get("prompts", [])
    sections = [
        ("Training", _plots(records)),
        ("Validation videos", _videos(run_dir, Path(page_dir or run_dir), prompts)),
        ("Window", _window(config)),
        ("Precompute", _precompute(run_dir)),
        ("Config (resolved)", f"<pre>{_esc(config_text) or 'no config.toml'}</pre>"),
        ("Environment (vt-train env)", _environment(run_dir)),
    ]
    body = "".join(f"<h2>{_esc(title)}</h2>{content}" for title, content in sections)
    title = f"vt run {run_dir.resolve().name}"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_esc(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{_esc(title)}</h1>"
        f"{_summary(run_dir, records, config)}{body}</body></html>"
    )


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the page (default <run_dir>/report.html) atomically: a reader never sees half a page."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / REPORT_FILE
    page = build_report(run_dir, out.parent)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out


class ReportWriter:
    """The trainer's side: rewrites report.html at a log interval, at most every `every_seconds`, on a thread of its
    own (building the page lists the window and reads the run's files: never on the training thread, whose steps
    must not wait on storage for it), and at the end on the caller's. A page that fails to build is a warning,
    never a stopped run."""

    def __init__(self, run_dir: Path, every_seconds: float, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.every_seconds = every_seconds
        self.enabled = enabled
        self._written = -float("inf")
        self._warned = False
        self._thread: threading.Thread | None = None

    def record_environment(self) -> None:
        """env.txt: the `vt-train env` block of this machine, once per run (the page shows it)."""
        if not self.enabled or (self.run_dir / ENV_FILE).is_file():
            return
        from vt.train.env import environment, format_environment

        (self.run_dir / ENV_FILE).write_text(format_environment(environment()) + "\n")

    def update(self, final: bool = False) -> threading.Thread | Path | None:
        """Start a rewrite when the interval has passed and none is running (returns its thread); `final`: wait for
        a running one, then write the last page here (returns its path, None if it failed)."""
        if not self.enabled:
            return None
        if final:
            self.wait()
            return self._write(final=True)
        now = time.monotonic()
        if now - self._written < self.every_seconds or (self._thread is not None and self._thread.is_alive()):
            return None
        self._written = now
        self._thread = threading.Thread(target=self._write, name="vt-report-page", daemon=True)
        self._thread.start()
        return self._thread

    def wait(self) -> None:
        """Until the rewrite in flight (if any) is done."""
        if self._thread is not None:
            self._thread.join()

    def _write(self, final: bool = False) -> Path | None:
        try:
            self.record_environment()
            return write_report(self.run_dir)
        except Exception as err:  # noqa: BLE001 - the page must never stop a training run
            if final or not self._warned:
                log.warning("could not write %s: %s", self.run_dir / REPORT_FILE, err)
                self._warned = True
            return None
