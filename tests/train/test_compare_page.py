"""`vt-train compare`: two run folders made by hand (metrics.jsonl lines, real mp4s, no training) become one page
that a real headless Chromium renders with a loss curve per run, the validation videos at the steps both runs
validated (only those) playing from the runs' own files, and nothing fetched from a network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from vt.shared.video_io import write_video
from vt.train.cli import app


def _run(root: Path, name: str, scale: float, steps: list[int], base: bool) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    records = [{"step": s, "loss": scale / s} for s in range(1, 5)]
    records += [{"step": 2, "eval_loss": scale * 0.6}, {"step": 4, "eval_loss": scale * 0.4}]
    records += [{"step": 2, "val/sharpness/0": scale, "val/sharpness": scale, "val/base/sharpness/0": 1.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    frames = np.random.default_rng(0).integers(0, 255, (4, 32, 32, 3), dtype=np.uint8)
    for step in steps:
        write_video(frames, run_dir / "validation" / f"step-{step:06d}" / "00.mp4")
    if base:
        write_video(frames, run_dir / "validation" / "base" / "00.mp4")
    return run_dir


CHECK = """(async () => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  const byTitle = {};
  for (const p of plots) {
    const title = (p.querySelector('.gtitle') || {}).textContent || '';
    byTitle[title] = {traces: p.data.length, names: p.data.map(t => t.name),
                      drawn: p.querySelectorAll('.scatterlayer .trace path.js-line').length};
  }
  const videos = [...document.querySelectorAll('video')];
  await Promise.all(videos.map(v => v.readyState >= 1 || v.error ? null :
    new Promise(resolve => { v.addEventListener('loadedmetadata', resolve, {once: true});
                             v.addEventListener('error', resolve, {once: true}); })));
  return {byTitle,
          rows: [...document.querySelectorAll('table.compare-videos tr[data-step]')].map(r => r.dataset.step),
          columns: [...document.querySelectorAll('table.compare-videos th')].map(th => th.textContent),
          videos: videos.map(v => ({src: v.currentSrc, ready: v.readyState, duration: v.duration,
                                    error: v.error && v.error.code}))};
})()"""


def test_compare_puts_two_runs_side_by_side_in_a_real_browser(tmp_path, browser, monkeypatch):
    a = _run(tmp_path, "lr-high", 1.0, [2, 4], base=True)
    b = _run(tmp_path, "lr-low", 2.0, [2], base=False)
    out = tmp_path / "pages" / "side.html"
    out.parent.mkdir()
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    # relative to the page's folder, not copied
    assert f"src='{os.path.relpath(a / 'validation', out.parent)}/step-000002/00.mp4'" in text
    assert not list(out.parent.glob("*.mp4"))

    seen, requests = browser.render(out, CHECK, tmp_path / "compare.png")
    plots = seen["byTitle"]
    assert plots["loss"]["names"] == ["lr-high", "lr-low"] and plots["loss"]["drawn"] == 2, plots
    assert plots["eval_loss"]["traces"] == 2, plots
    # run a: its prompt's curve and the base's; run b the same: one trace per run and curve
    assert plots["validation videos: sharpness"]["traces"] == 6, plots
    assert seen["rows"] == ["2"], seen["rows"]  # step 4 is only in lr-high
    assert seen["columns"] == ["step", "lr-high", "lr-low"]
    # lr-high's step-2 video beside its base's, lr-low's alone
    assert len(seen["videos"]) == 3, seen["videos"]
    for video in seen["videos"]:
        assert video["error"] is None and video["ready"] >= 1 and video["duration"] > 0, video
        assert video["src"].startswith("file://") and "/validation/" in video["src"]
    remote = [r for r in requests if "url" in r and not r["url"].startswith(("file://", "data:", "blob:"))]
    assert remote == [] and [r for r in requests if "failed" in r] == [], requests

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["compare", "lr-high", "lr-low"])
    assert result.exit_code == 0 and (tmp_path / "compare.html").is_file(), result.output
    assert "src='lr-low/validation/step-000002/00.mp4'" in (tmp_path / "compare.html").read_text()


def test_compare_refuses_a_folder_that_is_not_a_run_folder(tmp_path):
    run = _run(tmp_path, "run", 1.0, [], base=False)
    (tmp_path / "other").mkdir()
    result = CliRunner().invoke(app, ["compare", str(run), str(tmp_path / "other")])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines == [
        f"error: {tmp_path / 'other'} is not a run folder (no metrics.jsonl in it): pass the run.dir of a "
        "`vt-train run`, e.g. vt-train compare runs/a runs/b"
    ], lines
    assert not (tmp_path / "compare.html").exists()
