"""The report's training curves as plotly figures (train/report.py puts them on the page).

One figure per quantity, each from metrics.jsonl alone: every loss-like metric (loss, audio_loss, the held-out
eval_loss, any key ending in `loss`) raw and as a moving average, the held-out loss per sigma, the gap between the
held-out and the training loss (train/loss_gap.py, its widenings marked), the learning rate, the gradient norm, samples/s,
transformer tokens/s, the wait for data, the peak memory of every rank, and each metric of the validation videos
(the trained model's beside the base's and the stacked render's). plotly writes the HTML and the JavaScript that draws
it; vt writes none. `compare_figures`: the same curves with one trace per run (train/compare.py).
"""

from __future__ import annotations

import numpy as np

from vt.train.loss_gap import gaps, widenings
from vt.train.plots import moving_average

__all__ = ["compare_figures", "curve_figures", "loss_keys", "video_metric_curves"]
HEIGHT = 320  # pixels per figure
MAX_POINTS = 4000  # per curve: a long run's curves are thinned to this many points (the page stays small)


def loss_keys(records: list[dict]) -> list[str]:
    """The loss-like metrics present: `loss` first, then the others (`audio_loss` ...) by name."""
    keys = {
        key
        for record in records
        for key, value in record.items()
        if key.endswith("loss") and isinstance(value, (int, float))
    }
    return sorted(keys, key=lambda key: (key != "loss", key))


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _thin(steps: list, values: list) -> tuple[list, list]:
    """Every k-th point, and always the last, so a curve has at most about MAX_POINTS points."""
    stride = -(-len(values) // MAX_POINTS)
    if stride <= 1:
        return steps, values
    keep = list(range(0, len(values), stride))
    if keep[-1] != len(values) - 1:
        keep.append(len(values) - 1)
    return [steps[i] for i in keep], [values[i] for i in keep]


def _window(points: int) -> int:
    """The moving average's width: 1/20 of the points, at least 5, at most a quarter (as loss.png)."""
    return max(1, min(points // 4, max(5, points // 20)))


def _figure(title: str, y_title: str):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.update_layout(
        title=title,
        height=HEIGHT,
        margin=dict(l=60, r=20, t=40, b=40),
        template="plotly_white",
        legend=dict(orientation="h", y=-0.25),
        xaxis_title="step",
        yaxis_title=y_title,
    )
    return fig


def _from_zero(fig, values: list[float]) -> None:
    """The y axis from 0 to a little above the largest value: a constant (a flat learning rate) would
    otherwise sit on plotly's default range around itself and look like noise."""
    top = max(values, default=0.0)
    fig.update_yaxes(range=[0, top * 1.15 if top > 0 else 1.0])


def loss_figure(records: list[dict]):
    import plotly.graph_objects as go

    fig = _figure("loss", "loss")
    for key in loss_keys(records):
        steps, values = _series(records, key)
        x, y = _thin(steps, values)
        sparse = key == "eval_loss"  # computed every held_out.every steps: its points marked
        fig.add_trace(
            go.Scatter(x=x, y=y, mode="lines+markers" if sparse else "lines", name=key, opacity=1.0 if sparse else 0.35)
        )
        window = _window(len(values))
        if window > 1 and len(values) >= window:  # the average over every point, then thinned
            x, y = _thin(steps[window - 1 :], moving_average(np.array(values), window).tolist())
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=f"{key} (mean of {window})", line=dict(width=3)))
    return fig


def _single(records: list[dict], key: str, title: str, y_title: str, from_zero: bool = False):
    import plotly.graph_objects as go

    steps, values = _series(records, key)
    if not values:
        return None
    fig = _figure(title, y_title)
    x, y = _thin(steps, values)
    fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers" if len(values) < 50 else "lines", name=key))
    if from_zero:
        _from_zero(fig, values)
    return fig


def held_out_figure(records: list[dict]):
    """The held-out loss per sigma of `held_out.sigmas` (`eval_loss/sigma_<s>`), one curve each."""
    import plotly.graph_objects as go

    keys = sorted(
        {key for r in records for key in r if key.startswith("eval_loss/sigma_")},
        key=lambda key: float(key.rsplit("_", 1)[-1]),
    )
    if not keys:
        return None
    fig = _figure("held-out loss per sigma (data.eval, fixed noise)", "loss")
    for key in keys:
        x, y = _thin(*_series(records, key))
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"sigma {key.rsplit('_', 1)[-1]}"))
    return fig


def gap_figure(records: list[dict]):
    """The held-out loss minus the mean training loss since the evaluation before, at each held-out evaluation but the
    first; the evaluations at which it widened (train/loss_gap.py) marked."""
    import plotly.graph_objects as go

    found = gaps(records)
    if not found:
        return None
    fig = _figure("held-out gap (held-out loss - mean training loss since the evaluation before)", "gap")
    x, y = _thin([g.step for g in found], [g.gap for g in found])
    fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name="gap"))
    widened = {step for step, _ in widenings(records)}
    if widened:
        marked = [g for g in found if g.step in widened]
        fig.add_trace(
            go.Scatter(
                x=[g.step for g in marked],
                y=[g.gap for g in marked],
                mode="markers",
                name="widening",
                marker=dict(color="#d62728", size=11, symbol="triangle-up"),
            )
        )
    return fig


def memory_figure(records: list[dict]):
    import plotly.graph_objects as go

    ranks = sorted(
        {key for r in records for key in r if key.startswith("peak_mem_gb/")},
        key=lambda key: int(key.rsplit("rank", 1)[-1]) if key.rsplit("rank", 1)[-1].isdigit() else 0,
    )
    if not ranks:
        return None
    fig = _figure("peak memory per rank", "GiB")
    peaks = []
    for key in ranks:
        steps, values = _series(records, key)
        peaks += values
        x, y = _thin(steps, values)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=key.split("/", 1)[1]))
    _from_zero(fig, peaks)
    return fig


def video_metric_curves(records: list[dict]) -> dict[str, list[tuple[str, str]]]:
    """metric -> its curves' (key, name) in `records`' `val/...` keys: `val/<metric>/<prompt>` ("prompt 0"),
    `val/<kind>/<metric>/<prompt>` ("prompt 0 base"), the means `val/<metric>` ("mean"), `val/<kind>/<metric>`."""
    curves: dict[str, list[tuple[str, str]]] = {}
    for key in sorted({key for r in records for key in r if key.startswith("val/")}):
        parts = key.split("/")[1:]
        prompt = parts.pop() if parts[-1].isdigit() else None
        kind, metric = (parts[0], parts[1]) if len(parts) == 2 else ("", parts[0])
        name = " ".join(filter(None, [f"prompt {prompt}" if prompt else "mean", kind]))
        curves.setdefault(metric, []).append((key, name))
    return curves


def video_metric_figures(records: list[dict]) -> list:
    """One figure per metric of the validation videos (train/video_metrics): a curve per prompt and kind of render
    (`val/<metric>/<prompt>`: the trained model's; `val/<kind>/<metric>/<prompt>`: the base's, a stacked render's) and
    the mean over the prompts (`val/<metric>`, `val/<kind>/<metric>`). The base renders once per run (step 0) and
    stands beside every step's video, so a base curve with one value is drawn, dotted, at every step of the metric:
    the LoRA's curve against the base's at each step."""
    import plotly.graph_objects as go

    figures = []
    for metric, keys in video_metric_curves(records).items():
        fig = _figure(f"validation videos: {metric}", metric)
        steps = sorted({step for key, _ in keys for step in _series(records, key)[0]})
        for key, name in keys:
            x, y = _thin(*_series(records, key))
            if key.split("/")[1].startswith("base") and len(y) == 1 and len(steps) > 1:
                x, y = steps, y * len(steps)  # the one base render, beside each step's
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=name, line=dict(dash="dot")))
                continue
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=name))
        figures.append(fig)
    return figures


def curve_figures(records: list[dict]) -> list:
    """The figures that have data, in page order (an empty list for a run that has logged nothing)."""
    if not records:
        return []
    figures = [
        loss_figure(records) if loss_keys(records) else None,
        held_out_figure(records),
        gap_figure(records),
        _single(records, "lr", "learning rate", "lr", from_zero=True),
        _single(records, "grad_norm", "gradient norm (before clipping)", "norm"),
        _single(records, "samples_s", "samples/s", "samples/s", from_zero=True),
        _single(records, "tokens_s", "transformer tokens/s", "tokens/s", from_zero=True),
        _single(records, "data_wait_s", "data wait per log interval", "s", from_zero=True),
        memory_figure(records),
        *video_metric_figures(records),
    ]
    return [fig for fig in figures if fig is not None]


def compare_figures(runs: dict[str, list[dict]]) -> list:
    """`vt-train compare`'s figures: each loss-like metric (loss, eval_loss ...) with one curve per run, then each
    metric of the validation videos with each run's curves (a run's curves share its colour, a kind of curve its
    dash). `runs`: run name -> its records by step."""
    import plotly.colors
    import plotly.graph_objects as go

    colours = plotly.colors.qualitative.Plotly
    everything = [record for records in runs.values() for record in records]
    figures = []
    for key in loss_keys(everything):
        fig = _figure(key, key)
        for index, (run, records) in enumerate(runs.items()):
            steps, values = _series(records, key)
            x, y = _thin(steps, values)
            sparse = key == "eval_loss" or len(values) < 50
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines+markers" if sparse else "lines",
                    name=run,
                    line=dict(color=colours[index % len(colours)]),
                )
            )
        figures.append(fig)
    dashes = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
    for metric, keys in video_metric_curves(everything).items():
        fig = _figure(f"validation videos: {metric}", metric)
        for index, (run, records) in enumerate(runs.items()):
            for number, (key, name) in enumerate(keys):
                x, y = _thin(*_series(records, key))
                if y:
                    line = dict(color=colours[index % len(colours)], dash=dashes[number % len(dashes)])
                    fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"{run}: {name}", line=line))
        figures.append(fig)
    return figures
