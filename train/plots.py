"""The loss curve of a run, drawn from its metrics.jsonl so it needs no tracking service.

Drawn on a bare matplotlib Figure with the Agg canvas (no pyplot): no display, no global figure
state, safe to call from a training process or a test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vt.shared.errors import UserError
from vt.train.trackers import read_metrics

FIGSIZE = (8.0, 4.5)  # inches
DPI = 100  # -> an 800x450 PNG


def plot_loss(metrics_path: Path, out_png: Path, smooth: int = 0) -> Path:
    """Plot loss vs step (raw and a moving average), lr on a twin axis if logged; returns out_png.

    `smooth` is the moving-average window in logged points; 0 picks 1/20 of the points (at least 5,
    at most a quarter), so even a short run shows its trend through the noise of random sigmas.
    A resumed run may have logged some steps twice: the later record of a step wins.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_path, out_png = Path(metrics_path), Path(out_png)
    if smooth < 0:
        raise UserError(f"smooth must be >= 0 (0 picks a window), got {smooth}")
    by_step = {rec["step"]: rec for rec in read_metrics(metrics_path) if "loss" in rec}
    if not by_step:
        raise UserError(f"{metrics_path} has no 'loss' records to plot: log some training steps first")
    records = [by_step[step] for step in sorted(by_step)]
    steps = np.array([rec["step"] for rec in records], dtype=float)
    loss = np.array([rec["loss"] for rec in records], dtype=float)
    window = smooth or max(1, min(len(loss) // 4, max(5, len(loss) // 20)))

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, loss, color="tab:blue", alpha=0.35, linewidth=1, label="loss")
    if window > 1 and len(loss) >= window:
        ax.plot(
            steps[window - 1 :],
            moving_average(loss, window),
            color="tab:blue",
            linewidth=2,
            label=f"loss (mean of {window})",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()

    lr = [(rec["step"], rec["lr"]) for rec in records if "lr" in rec]
    if lr:
        ax_lr = ax.twinx()
        lr_steps, lr_values = zip(*lr)
        ax_lr.plot(lr_steps, lr_values, color="tab:orange", linewidth=1, linestyle="--", label="lr")
        ax_lr.set_ylabel("lr")
        ax_lr.set_ylim(0, max(lr_values) * 1.15)
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        more_handles, more_labels = ax_lr.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="upper right")
    ax.set_title(f"{metrics_path.resolve().parent.name}: loss over {int(steps[-1])} steps")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=DPI)
    return out_png


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of each full `window` of values (len(values) - window + 1 points)."""
    cumsum = np.cumsum(np.insert(np.asarray(values, dtype=float), 0, 0.0))
    return (cumsum[window:] - cumsum[:-window]) / window
