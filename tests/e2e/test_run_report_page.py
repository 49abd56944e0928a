"""`make demo`'s equivalent (scripts/pipeline.sh: both stages at once, on the tiny preset and real clips),
run once with no stdin and CI=true, then: its terminal shows each summary line once and no third-party
progress bar; its report.html renders in a real headless Chromium with every plot drawn, a validation
video playing and nothing fetched from a network; `vt-train report` rebuilds the page from the files."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers.cli_runs import BIN, write_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a cartoon rabbit in a green meadow", "people riding bikes down a street"]
# What tqdm draws: "  40%|####      | 4/10 [00:01<00:02, 3.1it/s]" or, with no total, "12it [00:01, 9.8it/s]".
BAR = re.compile(r"\d+%\|.*\||\d+(?:it| ?\w+) \[\d\d:\d\d")


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_model_factory, raw_shards):
    root = tmp_path_factory.mktemp("demo")
    run_dir = root / "run"
    config = write_config(
        root / "demo.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        run_dir,
        str(root / "window"),
        train={"epochs": 1, "checkpoint_every": 4},
        validation={"every": 4, "steps": 2, "prompts": PROMPTS},
        log={"progress": True, "report_every_seconds": 0.0},
    )
    env = {**os.environ, "CI": "true", "PATH": f"{BIN}:{os.environ['PATH']}"}
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY"):
        env.pop(name, None)  # the quiet terminal must come from vt, not from this test's environment
    out = subprocess.run(
        [str(ROOT / "scripts" / "pipeline.sh"), str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        timeout=600,
    )
    text = out.stdout.decode(errors="replace")
    (root / "terminal.txt").write_text(text)
    assert out.returncode == 0, text[-4000:]
    return run_dir, text


def test_the_terminal_shows_each_summary_line_once_and_no_library_progress_bar(demo):
    _, text = demo
    lines = [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]
    stage1 = re.compile(r"vt\.precompute: precompute \S+ \(lanes 0\): ")
    summaries = [line for line in lines if stage1.search(line) or re.search(r"vt\.train: done: ", line)]
    assert len([s for s in summaries if stage1.search(s)]) == 1, summaries
    assert len([s for s in summaries if "done: " in s]) == 1, summaries
    bars = [line for line in lines if BAR.search(line)]
    ours = [line for line in bars if re.match(r"(train|precompute\[\S+\]):", line)]
    assert ours, f"no progress line of vt's own:\n{text[-3000:]}"
    assert bars == ours, f"a library's progress bar reached the terminal: {[b for b in bars if b not in ours]}"
    for notice in (
        "Loading weights",
        "Loading pipeline components",
        "Loading checkpoint shards",
        "Writing model shards",
        "Fetching",
    ):
        assert notice not in text, f"{notice!r} reached the terminal:\n{text[-3000:]}"
    # one progress line per stage: the bar is redrawn in place (\r), never printed on new lines
    assert len({line.split(":")[0] for line in ours}) == 2


CHECK = """(async () => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  const drawn = plots.filter(p => p.querySelector('svg.main-svg') &&
                                  p.querySelectorAll('.scatterlayer .trace path.js-line').length > 0).length;
  const titles = plots.map(p => (p.querySelector('.gtitle') || {}).textContent || '');
  const video = document.querySelector('figure.trained video');
  await video.play();
  const start = video.currentTime;
  const until = Date.now() + 20000;
  while (video.currentTime <= start + 0.1 && !video.error && Date.now() < until) {
    await new Promise(resolve => video.addEventListener('timeupdate', resolve, {once: true}));
  }
  return {plots: plots.length, drawn, titles, videos: document.querySelectorAll('video').length,
          readyState: video.readyState, advanced: video.currentTime - start, error: video.error && video.error.code,
          src: video.currentSrc};
})()"""


def test_report_renders_in_a_real_browser_with_plots_drawn_a_video_playing_and_no_network(demo, tmp_path, browser):
    run_dir, _ = demo
    page = run_dir / "report.html"
    assert page.is_file() and "cdn.plot.ly/plotly" not in page.read_text()[:5000]
    screenshot = tmp_path / "report.png"
    seen, requests = browser.render(page, CHECK, screenshot)
    print(f"report screenshot: {screenshot}")
    assert seen["plots"] >= 6 and seen["drawn"] == seen["plots"], seen
    assert {"loss", "learning rate", "samples/s"} <= set(seen["titles"]), seen["titles"]
    steps = sorted(p.name for p in (run_dir / "validation").glob("step-*"))
    # every prompt at every step, each beside the base's video (validation.base)
    assert len(steps) >= 2 and seen["videos"] == 2 * len(PROMPTS) * len(steps), (steps, seen)
    assert seen["error"] is None and seen["readyState"] >= 2 and seen["advanced"] > 0.1, seen
    assert seen["src"].startswith("file://") and "/validation/step-" in seen["src"]
    remote = [r for r in requests if "url" in r and not r["url"].startswith(("file://", "data:", "blob:"))]
    assert remote == [], remote
    assert [r for r in requests if "failed" in r] == []
    assert screenshot.stat().st_size > 20_000


def test_vt_train_report_rebuilds_the_page_from_the_run_files(demo, tmp_path):
    run_dir, _ = demo
    out = tmp_path / "copy.html"
    result = subprocess.run(
        [str(BIN / "vt-train"), "report", str(run_dir), "--out", str(out)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    report = json.loads((run_dir / "precompute_report.json").read_text())
    assert f"<td>{report['committed']}</td>" in text
    # video links are relative to the page, wherever it is written
    assert f"src='{os.path.relpath(run_dir / 'validation', tmp_path)}/step-000004/00.mp4'" in text
    assert all(prompt in text for prompt in PROMPTS)
    assert "attention backends" in text  # the trainer's `vt-train env` block
    missing = subprocess.run(
        [str(BIN / "vt-train"), "report", str(tmp_path / "nothing")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "no run folder" in missing.stderr


def test_both_stages_record_their_start_up_up_to_their_first_work(demo):
    run_dir, _ = demo
    pre = json.loads((run_dir / "precompute_report.json").read_text())["startup"]
    train = json.loads((run_dir / "startup.json").read_text())
    for timeline, last in ((pre, "first_decoded_sample"), (train, "first_step")):
        marks = list(timeline["marks_s"].values())
        assert marks == sorted(marks) and list(timeline["marks_s"])[-1] == last, timeline
        assert sum(timeline["parts_s"].values()) == pytest.approx(marks[-1], abs=0.01)
        assert list(timeline["marks_s"])[0] == "imports" and 0 < marks[0] < marks[-1] < 300
    # the decode workers are started before the model spec and encoders are set up
    assert list(pre["marks_s"])[:3] == ["imports", "decode_workers_spawned", "model_spec"]
