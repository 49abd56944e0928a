"""A learning check on real clips: a full fine-tune of the tiny LTX-Video preset from its fixed random start over the
sample clips, with another clip's samples held out (`data.eval`: Big Buck Bunny, of which no piece trains), both
stages through their CLIs. The held-out loss
falls (the median of the last third of its evaluations below 0.9x the first), and the run page shows it beside the
training loss, and per sigma, in a real headless Chromium."""

from __future__ import annotations

import statistics

import pytest

from vt.train.trackers import read_metrics

from helpers.cli_runs import finish, start, write_config

pytestmark = pytest.mark.slow

CHECK = """(() => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  return plots.map(p => ({title: (p.querySelector('.gtitle') || {}).textContent || '',
                          names: (p.data || []).map(t => t.name),
                          drawn: p.querySelectorAll('.scatterlayer .trace path.js-line').length}));
})()"""


@pytest.fixture(scope="module")
def learned(tmp_path_factory, tiny_model_factory, clips_dir):
    from make_sample_shards import make_sample_shards

    root = tmp_path_factory.mktemp("held-out-learning")
    clips = sorted(clips_dir.glob("*.mp4"))
    held = [clip for clip in clips if clip.stem == "bigbuckbunny"]  # a clip none of whose pieces trains
    for folder, picked in (("train-raw", [c for c in clips if c not in held]), ("eval-raw", held)):
        make_sample_shards(picked, root / folder, seconds=1.5, per_shard=4, max_side=256)
    config = write_config(
        root / "run.toml",
        tiny_model_factory("ltx-video"),
        root / "train-raw",
        root / "run",
        str(root / "window"),
        buckets={"sizes": ["9x64x64"]},
        window={"size": "keep"},
        data={"eval": str(root / "eval-raw")},
        precompute={"workers": 0},
        train={"mode": "full", "lr": 1e-3, "batch_size": 2, "epochs": 8},
        held_out={"every": 2},
        log={"report_every_seconds": 0.0},
    )
    for stage in ("precompute", "train"):
        log = root / f"{stage}.log"
        finish(start(stage, config, log=log), log)
    return root / "run"


def test_the_held_out_loss_falls_and_the_page_shows_it_beside_the_training_loss(learned, tmp_path, browser):
    evaluations = [m["eval_loss"] for m in read_metrics(learned / "metrics.jsonl") if "eval_loss" in m]
    assert len(evaluations) >= 9, evaluations
    last_third = evaluations[-(len(evaluations) // 3) :]
    assert statistics.median(last_third) < 0.9 * evaluations[0], evaluations
    assert (learned / "eval" / "precompute_report.json").is_file()  # stage 1's report of the held-out data
    seen, _ = browser.render(learned / "report.html", CHECK, tmp_path / "report.png")
    by_title = {plot["title"]: plot for plot in seen}
    assert {"loss", "eval_loss"} <= set(by_title["loss"]["names"]), by_title["loss"]
    per_sigma = by_title["held-out loss per sigma (data.eval, fixed noise)"]
    assert per_sigma["names"] == [f"sigma {s:g}" for s in (0.1, 0.3, 0.5, 0.7, 0.9)] and per_sigma["drawn"] == 5
