"""The learning check on the demo's real clips: a LoRA trained to overfit one clip renders frames closer to that clip
than the base does, by the likeness metric and by plain pixel distance, and the run page shows it.

One real clip (carphone, a single 3 s piece) trains a LoRA (rank 32 on every linear layer, no gradient clipping) on
LTX-Video's tiny preset until it overfits; validation renders the clip's caption at the middle and the end, and the
base's render once (`validation.base`, same seed and noise), and `[metrics]` scores them with the tiny CLIP image tower
(`tiny_metric_models`; of the tiny image models its random embeddings separate these renders best) against
`metrics.reference`.

What "closer to the clip" is measured against: the tiny preset's VAE has random weights, so decode(encode(clip)) does
not look like the clip, and nothing this model renders can come nearer the clip's pixels than its own VAE's
reconstruction of them. The fair target is therefore the clip as the run's VAE reconstructs it: the latents stage 1
stored for it, decoded as LTXPipeline decodes (denormalised, then the VAE's decode), written as the reference video.
A LoRA that learned the clip renders that reconstruction; the base renders what its random weights make of the
caption. Both distances are to that reference: the likeness metric (higher is closer) and the mean absolute pixel
difference of the final step's render (lower is closer); the page plots the likeness of the LoRA's renders over the
steps against the base's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.config import load_config
from vt.shared.video_io import read_video, write_video
from vt.train.trackers import read_metrics

from helpers.cli_runs import write_config

pytestmark = pytest.mark.slow

CLIP, SECONDS = "carphone_pristine", 3.0  # a 4 s clip: one piece
STEPS, EVERY = 80, 40
EVERY_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"]


def reconstructed(window, model, out) -> np.ndarray:
    """The stored latents of the window's one sample, decoded as LTXPipeline decodes them, written to `out` (8 fps)."""
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline

    from vt.shared.shards import decode_shard

    shards = sorted((window / "data").rglob("*.safetensors"))
    tensors, keys, _ = decode_shard(shards[0].read_bytes())
    assert len(shards) == 1 and len(keys) == 1, (shards, keys)
    vae = AutoencoderKLLTXVideo.from_pretrained(model, subfolder="vae")
    assert not vae.config.timestep_conditioning  # the pipeline decodes it without a timestep
    latents = LTXPipeline._denormalize_latents(
        tensors["latents"][:1].float(), vae.latents_mean, vae.latents_std, vae.config.scaling_factor
    )
    with torch.no_grad():
        video = vae.decode(latents, None, return_dict=False)[0][0]  # (C, F, H, W) in [-1, 1]
    frames = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    write_video(frames, out, fps=8.0)
    return read_video(out)


@pytest.fixture(scope="module")
def overfit(tmp_path_factory, tiny_model_factory, tiny_metric_models, clips_dir):
    from make_sample_shards import CAPTIONS, make_sample_shards

    from vt.precompute.service import Precompute
    from vt.train.trainer import Trainer

    root = tmp_path_factory.mktemp("overfit")
    model = tiny_model_factory("ltx-video")
    make_sample_shards([clips_dir / f"{CLIP}.mp4"], root / "raw", seconds=SECONDS, per_shard=1, max_side=256)
    reference = root / "reference" / f"{CLIP}.mp4"
    reference.parent.mkdir()
    config = write_config(
        root / "run.toml",
        model,
        root / "raw",
        root / "run",
        str(root / "window"),
        buckets={"sizes": ["9x64x64"]},
        window={"size": "keep"},
        precompute={"workers": 0},
        adapter={"rank": 32, "alpha": 32.0, "targets": EVERY_LINEAR},
        train={"batch_size": 1, "lr": 1e-2, "max_grad_norm": 0.0, "epochs": STEPS, "checkpoint_every": 0},
        validation={"prompts": [CAPTIONS[CLIP]], "steps": 4, "every": EVERY},
        metrics={"likeness": str(tiny_metric_models["clip"]), "reference": [str(reference.parent)]},
        log={"report_every_seconds": 0.0},
    )
    Precompute(load_config(config)).run()
    target = reconstructed(root / "window", model, reference)
    Trainer(load_config(config)).run()
    return root / "run", target


def test_the_overfit_lora_renders_its_clip_closer_than_the_base(overfit):
    run, target = overfit
    records = read_metrics(run / "metrics.jsonl")
    lora = {r["step"]: r["val/likeness/00"] for r in records if "val/likeness/00" in r}
    base = [r["val/base/likeness/00"] for r in records if "val/base/likeness/00" in r]
    assert sorted(lora) == [EVERY, STEPS] and len(base) == 1, (lora, base)
    assert lora[STEPS] > base[0], (lora, base)
    distance = {}
    for name, path in (("lora", f"step-{STEPS:06d}/00.mp4"), ("base", "base/00.mp4")):
        frames = read_video(run / "validation" / path).astype(np.float32)
        distance[name] = float(np.abs(frames - target.astype(np.float32)).mean())  # of 255
    assert distance["lora"] < 0.85 * distance["base"], distance


CHECK = """(() => [...document.querySelectorAll('.js-plotly-plot')].map(p => ({
  title: (p.querySelector('.gtitle') || {}).textContent || '',
  traces: (p.data || []).map(t => ({name: t.name, x: [...t.x], y: [...t.y]})),
  drawn: p.querySelectorAll('.scatterlayer .trace').length})))()"""


def test_the_page_plots_the_loras_likeness_against_the_bases_at_every_step(overfit, tmp_path, browser):
    run, _ = overfit
    seen, requests = browser.render(run / "report.html", CHECK, tmp_path / "report.png")
    plot = {p["title"]: p for p in seen}["validation videos: likeness"]
    traces = {t["name"]: t for t in plot["traces"]}
    lora, base = traces["prompt 00"], traces["prompt 00 base"]
    assert lora["x"] == [EVERY, STEPS] and base["x"] == [0, EVERY, STEPS], plot  # the base: rendered at step 0
    assert len(set(base["y"])) == 1 and lora["y"][-1] > base["y"][-1], plot  # the one base render, beside each step
    assert plot["drawn"] == len(plot["traces"]), plot
    assert [r for r in requests if "failed" in r] == []
