"""<run.dir>/report.html: one page a person opens to see a run, built from the run's own files.

The trainer rewrites it at its log interval (at most every `log.report_every_seconds`, on a thread of its own)
and at the end; `vt-train report RUN_DIR` rebuilds it from a finished or running run. It shows the training curves
(train/report_plots.py) with the held-out gap's warnings (train/loss_gap.py), the validation videos per step, each
prompt's beside the base's (validation/base/) and a stacked render's beside the base's stacked one, the steps whose
exports `[keep_best]` kept (keep_best.json), the window's state (as `vt-precompute inspect` reads it), the precompute reports and rejected samples by
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
from vt.train.loss_gap import widenings
from vt.train.report_plots import curve_figures, loss_keys
from vt.train.trackers import read_metrics

__all__ = [
    "write_report",
    "metrics_by_step",
    "figures_html",
    "video_figure",
    "videos_by_prompt",
    "ENV_FILE",
    "REPORT_FILE",
    "STYLE",
]
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
.muted { color: #777; } .prompt { border: 1px solid #e4e4e4; padding: 0.4em; }
.pair { display: flex; gap: 0.4em; } .pair figure { max-width: 260px; } .caption { font-size: 0.9em; margin: 0.2em 0; }
.warning { background: #fff4e5; border-left: 4px solid #f0a020; padding: 0.4em 0.8em; }
.kept { background: #e6f4ea; padding: 0 0.4em; font-size: 0.8em; }
"""
VIDEO = re.compile(r"^(\d+)(?:-(\w+))?$")  # 00.mp4: prompt 0's plain video; 00-stacked.mp4: its render "stacked"


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


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def metrics_by_step(run_dir: Path) -> list[dict]:
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
    figures = curve_figures(records)
    if not figures:
        return "<p class='muted'>no training steps logged yet</p>"
    return figures_html(figures)


def figures_html(figures: list) -> str:
    """plotly figures as a grid of plots, plotly.js embedded once (the page fetches nothing)."""
    import plotly.io as pio

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


def video_figure(video: Path, page_dir: Path, caption: str, kind: str) -> str:
    src = Path(os.path.relpath(video, page_dir)).as_posix()
    return (
        f"<figure class='{kind}'><video src='{_esc(src)}' controls muted loop preload='auto'></video>"
        f"<figcaption>{_esc(caption)}</figcaption></figure>"
    )


def videos_by_prompt(folder: Path) -> dict[int, dict[str, Path]]:
    """prompt index -> render name ("" for the plain video) -> its video in `folder`."""
    out: dict[int, dict[str, Path]] = defaultdict(dict)
    for video in sorted(folder.glob("*.mp4")) if folder.is_dir() else []:
        match = VIDEO.match(video.stem)
        if match:
            out[int(match[1])][match[2] or ""] = video
    return out


def _videos(run_dir: Path, page_dir: Path, prompts: list[str], kept: dict) -> str:
    """Every validation step's videos, each prompt's (and each render's) beside the base's of the same seed."""
    steps = sorted((p for p in (run_dir / "validation").glob("step-*") if p.is_dir()), key=lambda p: p.name)
    base = videos_by_prompt(run_dir / "validation" / "base")
    blocks = []
    for step in steps:
        number = re.sub(r"^step-0*(?=\d)", "", step.name)
        cells = []
        for index, renders in sorted(videos_by_prompt(step).items()):
            prompt = prompts[index] if index < len(prompts) else f"prompt {index}"
            pairs = []
            for name, video in sorted(renders.items()):
                label = f" + {name}" if name else ""
                figures = (
                    [video_figure(base[index][name], page_dir, f"base{label}", "base")] if name in base[index] else []
                )
                figures.append(video_figure(video, page_dir, f"step {number}{label}", "trained"))
                pairs.append(f"<div class='pair' data-render='{_esc(name)}'>{''.join(figures)}</div>")
            cells.append(
                f"<div class='prompt' data-prompt='{index}'>{''.join(pairs)}<p class='caption'>{_esc(prompt)}</p></div>"
            )
        if cells:
            mark = ""
            if number.isdigit() and int(number) in kept.get("kept", []):
                mark = f" <span class='kept'>export kept ({_esc(kept.get('by', ''))})</span>"
            blocks.append(f"<h3>step {_esc(number)}{mark}</h3><div class='step'>{''.join(cells)}</div>")
    return "".join(blocks) or "<p class='muted'>no validation videos yet (validation.every, validation.prompts)</p>"


def _kept(run_dir: Path, page_dir: Path, record: dict) -> str:
    """The steps whose exports [keep_best] kept (keep_best.json), best first."""
    if not record:
        return "<p class='muted'>no exports kept by step ([keep_best] count = k keeps the k best steps')</p>"
    scores = {int(step): value for step, value in record.get("scores", {}).items()}
    best = record.get("best", [])
    goal = record.get("goal", "min")
    order = sorted(
        record.get("kept", []), key=lambda s: (s not in best, scores.get(s, 0) * (1 if goal == "min" else -1))
    )
    rows = []
    for step in order:
        folder = run_dir / "exports" / f"step-{step:06d}"
        link = Path(os.path.relpath(folder, page_dir)).as_posix()
        why = f"best {best.index(step) + 1} of {record.get('count')}" if step in best else "newest (kept)"
        rows.append(
            f"<tr data-step='{step}'><td>{step}</td><td>{scores.get(step, float('nan')):.6g}</td>"
            f"<td>{_esc(why)}</td><td><a href='{_esc(link)}'>{_esc(link)}</a></td></tr>"
        )
    head = f"<tr><th>step</th><th>{_esc(record.get('by'))}</th><th>why</th><th>export</th></tr>"
    text = (
        f"<p>the {record.get('count')} best steps by {_esc(record.get('by'))} ({'lowest' if goal == 'min' else 'highest'}"
        f" best) of {len(scores)} measured: steps {', '.join(map(str, best)) or '-'}; the other steps' exports are "
        "deleted, never the newest.</p>"
    )
    return text + f"<table class='kept-exports'>{head}{''.join(rows)}</table>"


def _gap_warnings(records: list[dict]) -> str:
    return "".join(f"<p class='warning'>step {step}: {_esc(text)}</p>" for step, text in widenings(records))


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
    records = metrics_by_step(run_dir)
    prompts = config.get("validation", {}).get("prompts", [])
    page_dir = Path(page_dir or run_dir)
    kept = _read_json(run_dir / "keep_best.json")
    sections = [
        ("Training", _gap_warnings(records) + _plots(records)),
        ("Validation videos", _videos(run_dir, page_dir, prompts, kept)),
        ("Kept exports", _kept(run_dir, page_dir, kept)),
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
