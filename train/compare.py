"""`vt-train compare RUN [RUN ...]`: one page that puts runs side by side, built from their run folders alone.

Each loss-like curve (the training loss, the held-out loss) with one trace per run on shared axes, each metric of
the validation videos per run (train/report_plots.py `compare_figures`), and a table of the validation videos at the
steps every run validated: a row per step, a column per run, each cell the run's videos of that step beside its
base's (validation/base/). As the run page (train/report.py): plotly.js embedded, the videos relative links to the
runs' own mp4s, so the page opens as a file and fetches nothing.
"""

from __future__ import annotations

import html
import os
import re
import time
from pathlib import Path

from vt.shared.errors import UserError
from vt.train.report import STYLE, figures_html, metrics_by_step, video_figure, videos_by_prompt
from vt.train.report_plots import compare_figures

__all__ = ["write_compare", "COMPARE_FILE"]
COMPARE_FILE = "compare.html"  # in the current directory, unless --out says otherwise
CELLS = ".compare-videos td { vertical-align: top; text-align: left; } .compare-videos figure { width: 220px; }"


def _esc(value) -> str:
    return html.escape(str(value))


def _names(run_dirs: list[Path]) -> list[str]:
    """A column name per run: its folder's name, or its path where two folders share a name."""
    names = [path.resolve().name for path in run_dirs]
    return [name if names.count(name) == 1 else str(path) for name, path in zip(names, run_dirs)]


def _check(run_dir: Path) -> None:
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(
            f"{run_dir} is not a run folder (no metrics.jsonl in it): pass the run.dir of a `vt-train run`, "
            "e.g. vt-train compare runs/a runs/b"
        )


def _steps(run_dir: Path) -> dict[str, Path]:
    """'step-000002' -> its folder, for each validation step that holds videos."""
    folder = run_dir / "validation"
    return {p.name: p for p in sorted(folder.glob("step-*")) if p.is_dir() and any(p.glob("*.mp4"))}


def _cell(step: Path, base: dict, page_dir: Path, number: str) -> str:
    parts = []
    for index, renders in sorted(videos_by_prompt(step).items()):
        for name, video in sorted(renders.items()):
            label = f" + {name}" if name else ""
            figures = [video_figure(base[index][name], page_dir, f"base{label}", "base")] if name in base[index] else []
            figures.append(video_figure(video, page_dir, f"prompt {index}, step {number}{label}", "trained"))
            parts.append(f"<div class='pair' data-prompt='{index}' data-render='{_esc(name)}'>{''.join(figures)}</div>")
    return "".join(parts)


def _videos(run_dirs: list[Path], names: list[str], page_dir: Path) -> str:
    steps = [_steps(run_dir) for run_dir in run_dirs]
    shared = sorted(set.intersection(*(set(s) for s in steps)))
    if not shared:
        return "<p class='muted'>no validation step is in every run (validation.every, validation.prompts)</p>"
    bases = [videos_by_prompt(run_dir / "validation" / "base") for run_dir in run_dirs]
    head = "<tr><th>step</th>" + "".join(f"<th>{_esc(name)}</th>" for name in names) + "</tr>"
    rows = []
    for folder in shared:
        number = re.sub(r"^step-0*(?=\d)", "", folder)
        cells = "".join(
            f"<td data-run='{_esc(name)}'>{_cell(run_steps[folder], base, page_dir, number)}</td>"
            for name, run_steps, base in zip(names, steps, bases)
        )
        rows.append(f"<tr data-step='{_esc(number)}'><td>{_esc(number)}</td>{cells}</tr>")
    return f"<table class='compare-videos'>{head}{''.join(rows)}</table>"


def build_compare(run_dirs: list[Path], page_dir: Path) -> str:
    """The page's HTML for `run_dirs`; video links relative to `page_dir`."""
    run_dirs = [Path(run_dir) for run_dir in run_dirs]
    for run_dir in run_dirs:
        _check(run_dir)
    names = _names(run_dirs)
    figures = compare_figures({name: metrics_by_step(run_dir) for name, run_dir in zip(names, run_dirs)})
    plots = figures_html(figures) if figures else "<p class='muted'>no run has logged a step yet</p>"
    runs = "".join(f"<li>{_esc(name)}: {_esc(run_dir.resolve())}</li>" for name, run_dir in zip(names, run_dirs))
    title = f"vt compare {', '.join(names)}"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_esc(title)}</title>"
        f"<style>{STYLE}{CELLS}</style></head><body><h1>{_esc(title)}</h1>"
        f"<ul>{runs}</ul><p class='muted'>Built {_esc(time.strftime('%Y-%m-%d %H:%M:%S'))}.</p>"
        f"<h2>Curves</h2>{plots}<h2>Validation videos at the steps every run validated</h2>"
        f"{_videos(run_dirs, names, page_dir)}</body></html>"
    )


def write_compare(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the page (default ./compare.html) atomically; returns its path."""
    out = Path(out) if out else Path(COMPARE_FILE)
    page = build_compare(run_dirs, out.parent)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out
