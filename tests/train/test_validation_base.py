"""A LoRA you can judge before you ship it, on one real run of LTX-Video's tiny preset (kept window, two prompts):

- `validation.base`: each prompt also rendered by the base (the adapters switched off), with the same seed and noise,
  once per run (validation/base/ and base.json), reused at every later validation and by a resumed run; the trained
  LoRA renders otherwise (a full fine-tune's base, its step-0 render: tests/train/test_export.py);
- `[validation_stack]`: a LoRA file vt exported stacked for one more video of each prompt (`<prompt>-stacked.mp4`,
  and the base's stacked one), which differs from the plain video;
- `[keep_best]`: the exports of the 2 best steps by a metric metrics.jsonl logs (the training loss), and the newest,
  the others deleted;
- the run page, in Chromium: each prompt's base beside its step's video, the kept steps named.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vt.shared.config import load_config
from vt.shared.video_io import read_video
from vt.train.trackers import read_metrics

from helpers.cli_runs import write_config

PROMPTS = ["a cartoon rabbit in a green meadow", "people riding bikes down a street"]


def stack_file(model, folder) -> str:
    """A LoRA vt exports (pytorch_lora_weights.safetensors) with random, non-zero factors: a turbo LoRA's stand-in."""
    from peft.utils import get_peft_model_state_dict

    from vt.shared.adapters import is_adapter
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    spec = build_spec(ModelConfig(family="ltx-video", path=str(model)), frame_rate=8.0)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=4.0, targets=None)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if is_adapter(name):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return str(spec.save_lora(get_peft_model_state_dict(transformer), folder))


def config_for(tmp_path, model, raw, window, name: str, **sections):
    return write_config(
        tmp_path / f"{name}.toml",
        model,
        raw,
        tmp_path / name,
        str(window),
        window={"size": "keep"},
        train={"batch_size": 1, "epochs": 100, "lr": 2e-2, "checkpoint_every": 2, **sections.pop("train", {})},
        validation={"prompts": PROMPTS, "steps": 2, **sections.pop("validation", {})},
        **sections,
    )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_factory, raw_shards, kept_window):
    from vt.precompute.validation_conditions import encode_validation_inputs
    from vt.train.trainer import Trainer

    root = tmp_path_factory.mktemp("judge")
    model = tiny_model_factory("ltx-video")
    stack = stack_file(model, root / "turbo")
    config = config_for(
        root,
        model,
        raw_shards,
        kept_window,
        "lora",
        train={"max_steps": 4},
        validation={"every": 2},
        validation_stack={"loras": [stack], "steps": 3, "guidance_scale": 1.0},
        keep_best={"count": 2, "by": "loss"},
    )
    encode_validation_inputs(load_config(config))  # the prompts' conditions, into the kept window
    Trainer(load_config(config)).run()
    return root, config, model


def frames(path) -> np.ndarray:
    return read_video(path).astype(np.int16)


def test_the_base_renders_once_beside_every_step_and_the_lora_moves_away_from_it(lora_run):
    root, _, _ = lora_run
    validation = root / "lora" / "validation"
    base = validation / "base"
    assert json.loads((base / "base.json").read_text())["step"] == 0  # before the first step, adapters off
    names = [f"{i:02d}{suffix}.mp4" for i in range(len(PROMPTS)) for suffix in ("", "-stacked")]
    assert sorted(p.name for p in base.glob("*.mp4")) == sorted(names)
    for step in (2, 4):
        assert sorted(p.name for p in (validation / f"step-{step:06d}").iterdir()) == sorted(names)
    # made once: older than step 2's videos (a later render would be newer than them)
    first = min(p.stat().st_mtime_ns for p in (validation / "step-000002").iterdir())
    assert max(p.stat().st_mtime_ns for p in base.iterdir()) < first
    for index in range(len(PROMPTS)):
        moved = np.abs(frames(validation / "step-000004" / f"{index:02d}.mp4") - frames(base / f"{index:02d}.mp4"))
        assert moved.mean() > 0.5, f"prompt {index}: the trained LoRA renders as the base"
        stacked = frames(validation / "step-000004" / f"{index:02d}-stacked.mp4")
        assert np.abs(stacked - frames(validation / "step-000004" / f"{index:02d}.mp4")).mean() > 0.5
        assert np.abs(frames(base / f"{index:02d}-stacked.mp4") - frames(base / f"{index:02d}.mp4")).mean() > 0.5


def test_keep_best_keeps_the_two_best_steps_and_the_newest(lora_run):
    root, _, _ = lora_run
    losses = {r["step"]: r["loss"] for r in read_metrics(root / "lora" / "metrics.jsonl")}
    best = sorted(sorted(losses, key=lambda s: (losses[s], s))[:2])
    record = json.loads((root / "lora" / "keep_best.json").read_text())
    assert record["best"] == best and record["kept"] == sorted(set(best) | {4})
    assert {int(k): v for k, v in record["scores"].items()} == pytest.approx(losses)
    kept = sorted(int(p.name.removeprefix("step-")) for p in (root / "lora" / "exports").iterdir())
    assert kept == record["kept"]
    for step in kept:
        assert (root / "lora" / "exports" / f"step-{step:06d}" / "lora" / "pytorch_lora_weights.safetensors").is_file()


CHECK = """(async () => {
  const prompts = [...document.querySelectorAll('.step')].map(step => [...step.querySelectorAll('.prompt')]);
  const pairs = [...document.querySelectorAll('.pair')].map(pair => ({
    render: pair.dataset.render,
    base: (pair.querySelector('figure.base video') || {}).currentSrc || null,
    trained: (pair.querySelector('figure.trained video') || {}).currentSrc || null,
    side: (() => { const [a, b] = pair.querySelectorAll('figure');
                   return a && b ? b.getBoundingClientRect().left > a.getBoundingClientRect().right - 1 : false; })(),
  }));
  const videos = [...document.querySelectorAll('video')];
  await Promise.all(videos.map(v => v.readyState >= 2 ? null :
    new Promise(resolve => { v.addEventListener('loadeddata', resolve, {once: true});
                             v.addEventListener('error', resolve, {once: true}); setTimeout(resolve, 20000); })));
  return {steps: prompts.length, perStep: prompts.map(p => p.length), pairs,
          loaded: videos.filter(v => v.readyState >= 2).length, videos: videos.length,
          kept: [...document.querySelectorAll('table.kept-exports tr[data-step]')].map(r => +r.dataset.step),
          marked: [...document.querySelectorAll('h3 .kept')].map(s => s.parentElement.textContent)};
})()"""


def test_the_page_shows_each_prompts_base_beside_its_videos_and_names_the_kept_steps(lora_run, tmp_path, browser):
    root, _, _ = lora_run
    seen, requests = browser.render(root / "lora" / "report.html", CHECK, tmp_path / "page.png")
    assert seen["steps"] == 2 and seen["perStep"] == [len(PROMPTS)] * 2, seen
    assert len(seen["pairs"]) == 2 * len(PROMPTS) * 2  # plain and stacked, per prompt, per step
    for pair in seen["pairs"]:
        suffix = "-stacked.mp4" if pair["render"] == "stacked" else ".mp4"
        assert pair["base"].endswith(suffix) and "/validation/base/" in pair["base"], pair
        assert pair["trained"].endswith(suffix) and "/validation/step-" in pair["trained"], pair
        assert pair["base"].rsplit("/", 1)[1] == pair["trained"].rsplit("/", 1)[1] and pair["side"], pair
    assert seen["loaded"] == seen["videos"] == 2 * len(seen["pairs"]), seen
    record = json.loads((root / "lora" / "keep_best.json").read_text())
    assert sorted(seen["kept"]) == record["kept"]
    assert [text.split()[1] for text in seen["marked"]] == [str(s) for s in record["kept"] if s in (2, 4)]
    assert [r for r in requests if "failed" in r] == []


def test_a_resumed_run_reuses_the_base(lora_run):
    from vt.train.trainer import Trainer

    root, config, _ = lora_run
    base = root / "lora" / "validation" / "base"
    before = {p.name: p.stat().st_mtime_ns for p in base.iterdir()}
    resumed = load_config(config)
    resumed.train.max_steps = 5
    Trainer(resumed).run()
    assert {p.name: p.stat().st_mtime_ns for p in base.iterdir()} == before  # not rendered again
    assert (root / "lora" / "validation" / "step-000005" / "00.mp4").is_file()
