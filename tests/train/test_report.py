"""report.html from a run folder's files, without a browser (tests/e2e/test_run_report_page.py renders a real run's)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vt.shared.video_io import write_video
from vt.train.report import ReportWriter, build_report, write_report
from vt.train.report_plots import curve_figures, loss_keys

PROMPTS = ["a red fox", "a <b>bold</b> prompt"]


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "validation" / "step-000004").mkdir(parents=True)
    records = [
        {
            "step": s,
            "loss": 1.0 / s,
            "audio_loss": 0.5 / s,
            "lr": 1e-3,
            "grad_norm": 0.1 * s,
            "samples_s": 4.0,
            "tokens_s": 96.0,
            "data_wait_s": 0.01,
            "peak_mem_gb/rank0": 0.5,
            "peak_mem_gb/rank1": 0.6,
            "time": 1e9 + s,
        }
        for s in range(1, 9)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.toml").write_text(
        '[model]\nfamily = "ltx-video"\npath = "m"\n[train]\nmode = "lora"\n'
        f'[validation]\nprompts = {json.dumps(PROMPTS)}\n[window]\nuri = "{run}/nowindow"\n'
    )
    frames = np.zeros((9, 32, 32, 3), dtype=np.uint8)
    for index in range(2):
        write_video(frames, run / "validation" / "step-000004" / f"{index:02d}.mp4", fps=8.0)
    (run / "precompute_report.json").write_text(
        json.dumps(
            {
                "rank": 0,
                "status": "done",
                "seen": 5,
                "committed": 4,
                "rejected_total": 1,
                "shards": 2,
                "bytes": 2e6,
                "elapsed_s": 2.0,
                "samples_per_s": 2.0,
                "seconds": {"decode": 0.5, "vae_encode": 1.0},
            }
        )
    )
    (run / "rejects.jsonl").write_text(
        json.dumps(
            {
                "epoch": 0,
                "shard": "raw-0.tar",
                "position": 3,
                "key": "raw-0/000003",
                "reason": "too_short",
                "detail": "4 frames",
            }
        )
        + "\n"
        + '{"torn'
    )
    (run / "env.txt").write_text("torch: 2.13.0\n")
    return run


def test_every_loss_like_metric_is_plotted_and_a_constant_lr_axis_starts_at_zero(run_dir):
    from vt.train.report import metrics_by_step

    records = metrics_by_step(run_dir)
    assert loss_keys(records) == ["loss", "audio_loss"]
    figures = {fig.layout.title.text: fig for fig in curve_figures(records)}
    assert set(figures) == {
        "loss",
        "learning rate",
        "gradient norm (before clipping)",
        "samples/s",
        "transformer tokens/s",
        "data wait per log interval",
        "peak memory per rank",
    }
    names = [trace.name for trace in figures["loss"].data]
    assert names == ["loss", "loss (mean of 2)", "audio_loss", "audio_loss (mean of 2)"]
    assert tuple(figures["learning rate"].layout.yaxis.range) == pytest.approx((0, 1.15e-3))
    assert [t.name for t in figures["peak memory per rank"].data] == ["rank0", "rank1"]


def test_the_page_links_videos_with_their_prompts_lists_rejects_and_is_written_atomically(run_dir, tmp_path):
    page = write_report(run_dir)
    text = page.read_text()
    assert page == run_dir / "report.html" and not list(run_dir.glob(".*.tmp"))
    assert text.count("<video ") == 2 and "src='validation/step-000004/00.mp4'" in text
    assert "a red fox" in text and "a &lt;b&gt;bold&lt;/b&gt; prompt" in text  # prompts escaped
    assert "too_short: 1" in text and "raw-0/000003" in text
    assert "<td>vae_encode</td><td>1.0</td><td>4.00</td>" in text  # samples/s of the stage
    assert "torch: 2.13.0" in text and "window" in text and "not found" in text
    assert "<script" in text and "https://cdn" not in text.split("<script", 1)[0]
    elsewhere = tmp_path / "pages"
    elsewhere.mkdir()
    assert "src='../run/validation/step-000004/01.mp4'" in build_report(run_dir, elsewhere)


def test_the_trainers_writer_waits_its_interval_and_a_failure_is_a_warning(run_dir, capsys):
    """The page is written on a thread of its own (off the training thread), at most once per interval, and the
    last one on the caller's thread."""
    import threading

    writer = ReportWriter(run_dir, every_seconds=3600)
    thread = writer.update()
    assert isinstance(thread, threading.Thread) and thread is not threading.current_thread()
    writer.wait()
    assert (run_dir / "report.html").is_file()
    (run_dir / "report.html").unlink()
    assert writer.update() is None and not (run_dir / "report.html").exists()  # within the interval
    assert writer.update(final=True) == run_dir / "report.html"
    (run_dir / "metrics.jsonl").write_text('{"broken\n{"step": 1}\n')  # a broken line inside the file
    assert writer.update(final=True) is None
    assert "could not write" in capsys.readouterr().err  # vt's logger writes to stderr


def test_a_long_runs_curves_are_thinned_keeping_the_last_step(monkeypatch):
    import vt.train.report_plots as plots

    monkeypatch.setattr(plots, "MAX_POINTS", 100)
    records = [{"step": s, "loss": float(s % 7), "lr": 1e-4} for s in range(1, 1002)]
    figures = {fig.layout.title.text: fig for fig in curve_figures(records)}
    raw, average = figures["loss"].data
    assert len(raw.x) <= 101 and raw.x[0] == 1 and raw.x[-1] == 1001
    assert average.name == "loss (mean of 50)" and average.x[-1] == 1001 and len(average.y) <= 101
    assert average.y[-1] == pytest.approx(np.mean([s % 7 for s in range(952, 1002)]))  # the mean over every point
