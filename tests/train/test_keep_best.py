"""[keep_best] (train/parts/keep_best.py) and the held-out gap (train/loss_gap.py): which steps' exports stay, when the
gap between the held-out and the training loss counts as widening, the trainer's warning, and the run page's gap plot,
warning and kept steps in Chromium. tests/train/test_validation_base.py runs keep_best in a real run."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vt.shared.config import Config
from vt.shared.errors import UserError
from vt.shared.video_io import write_video
from vt.train.loss_gap import gaps, widening, widenings
from vt.train.parts import Parts, RunContext
from vt.train.parts.keep_best import best_steps, kept_steps
from vt.train.report import write_report


def test_the_k_best_steps_and_the_newest_are_kept():
    scores = {2: 0.5, 4: 0.3, 6: 0.3, 8: 0.9, 10: 0.7}
    assert best_steps(scores, 2, "min") == [4, 6] and kept_steps(scores, 2, "min") == [4, 6, 10]
    assert best_steps(scores, 2, "max") == [8, 10] and kept_steps(scores, 2, "max") == [8, 10]
    assert best_steps(scores, 1, "min") == [4]  # a tie: the earlier step
    assert kept_steps({}, 2, "min") == []
    with pytest.raises(UserError, match='keep_best.by = "held_out" ranks steps by the held-out loss'):
        Parts(Config.model_validate({"keep_best": {"count": 2}}))["keep_best"].check(None, 1)
    Parts(Config.model_validate({"keep_best": {"count": 2, "by": "val/sharpness"}}))["keep_best"].check(None, 1)


def records(evaluations: list[tuple[float, float]], every: int = 4) -> list[dict]:
    """Records of `every` logged steps per held-out evaluation: (training loss of each, held-out loss at the last)."""
    out = []
    for index, (train, held_out) in enumerate(evaluations):
        for k in range(1, every + 1):
            step = index * every + k
            out.append({"step": step, "loss": train + (0.01 if k % 2 else -0.01)})
        out[-1]["eval_loss"] = held_out
    return out


# training loss falling, held-out loss rising from the second evaluation: gaps 0.1, 0.2, 0.35, 0.5 after the first
WIDENING = [(1.0, 1.0), (0.9, 1.0), (0.8, 1.0), (0.7, 1.05), (0.6, 1.1)]


def test_the_gap_widens_when_it_grows_at_each_of_three_evaluations_by_more_than_a_tenth_of_the_loss(caplog):
    found = gaps(records(WIDENING))
    assert [g.step for g in found] == [8, 12, 16, 20]  # every evaluation but the first
    assert [round(g.gap, 6) for g in found] == [0.1, 0.2, 0.35, 0.5]
    assert widening(found[:2]) is None  # fewer than three gaps
    assert "steps 8, 12, 16" in widening(found[:3]) and [s for s, _ in widenings(records(WIDENING))] == [16, 20]
    flat = [(1.0, 1.0), (0.9, 1.0), (0.89, 1.0), (0.88, 1.0)]  # grows at each, by less than 10% of the loss
    assert widenings(records(flat)) == []
    wobbly = [(1.0, 1.0), (0.9, 1.0), (0.7, 1.0), (0.75, 1.0), (0.5, 1.0)]  # not at every evaluation
    assert [s for s, _ in widenings(records(wobbly))] == []

    # the trainer's side: the held-out part warns at each evaluation where it widened, from the records it is given
    part = Parts(Config.model_validate({"data": {"eval": "held-out"}, "held_out": {"every": 4}}))["held_out"]
    part.start(RunContext(None, torch.device("cpu"), world=SimpleNamespace(is_main=True)))
    with caplog.at_level(logging.WARNING, logger="vt.train.held_out"):
        for record in records(WIDENING):
            part.logged(record["step"], record)
    warned = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert [m.split(":")[0] for m in warned] == ["step 16", "step 20"], warned


CHECK = """(async () => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  const gap = plots.find(p => ((p.querySelector('.gtitle') || {}).textContent || '').startsWith('held-out gap'));
  return {gap: !!gap, drawn: gap ? gap.querySelectorAll('.scatterlayer .trace').length : 0,
          traces: gap ? gap.data.map(t => [t.name, t.x]) : [],
          warnings: [...document.querySelectorAll('p.warning')].map(p => p.textContent),
          kept: [...document.querySelectorAll('table.kept-exports tr[data-step]')].map(r =>
            [...r.querySelectorAll('td')].map(td => td.textContent)),
          marked: [...document.querySelectorAll('h3 .kept')].map(s => s.parentElement.textContent)};
})()"""


def test_the_page_plots_the_gap_warns_and_names_the_kept_steps_in_chromium(tmp_path, browser):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(WIDENING)))
    scores = {4: 0.9, 8: 0.7, 12: 0.8, 16: 1.0, 20: 1.1}
    (run / "keep_best.json").write_text(
        json.dumps(
            {
                "by": "eval_loss",
                "goal": "min",
                "count": 2,
                "scores": {str(s): v for s, v in scores.items()},
                "best": best_steps(scores, 2, "min"),
                "kept": kept_steps(scores, 2, "min"),
            }
        )
    )
    for step in (8, 20):
        write_video(np.zeros((9, 32, 32, 3), np.uint8), run / "validation" / f"step-{step:06d}" / "00.mp4", fps=8.0)
    seen, _ = browser.render(write_report(run), CHECK, tmp_path / "page.png")
    assert seen["gap"] and seen["drawn"] == 2, seen  # the gap, and the evaluations where it widened
    assert seen["traces"] == [["gap", [8, 12, 16, 20]], ["widening", [16, 20]]]
    assert [w.split(":")[0] for w in seen["warnings"]] == ["step 16", "step 20"] and "widened" in seen["warnings"][0]
    assert [row[:3] for row in seen["kept"]] == [
        ["8", "0.7", "best 1 of 2"],
        ["12", "0.8", "best 2 of 2"],
        ["20", "1.1", "newest (kept)"],
    ]
    assert seen["kept"][0][3].endswith("exports/step-000008")
    assert [m.split()[1] for m in seen["marked"]] == ["8", "20"]  # the validation steps whose exports stay
