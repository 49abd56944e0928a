"""Every file in configs/ through both stages, as a user runs it, with its family's tiny preset.

The config keeps what makes it itself: family, dtypes, text length, frame rate, shard size, batch
size, accumulation, LoRA settings, activation checkpointing, trackers, validation prompts. Only
what would take hours on 2 cores is lowered with --set: bucket sizes (same aspects, the family's
smallest frame count), intervals, validation steps, worker count; an image-to-video config's
validation images (the user's files) become one test image per prompt, and a config whose family trains
on a control video reads the raw shards with one per sample (`control_shards`) and validates under a
test control video, and one that trains sound (`model.audio`) reads them with a sound track in every sample
(`sound_shards`) and logs the audio loss, its validation videos carrying a sound track. Both CLIs run as processes at
once and the trainer must finish with every sample trained once per epoch. For the configs in KILLED
(one per kind of training state: a LoRA, one expert of two, both experts, a full fine-tune, two block lists, an
audio-video transformer) the trainer is SIGKILLed right after its second checkpoint (after a validation) and resumed,
checkpointing and validating every 2 steps, over at most two epochs (stage 1 encodes every epoch afresh: each more
epoch is the whole corpus again, through both stages); the others' state is of those kinds, so
they train one epoch and checkpoint and validate at its end only, without the base's videos. A new config is covered by
adding the file. `test_shipped_configs_start_under_pipeline_parallel` starts each under parallel.pp = 2.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from vt.shared.buckets import parse_buckets
from vt.shared.config import load_config
from vt.shared.models import build_spec, get_spec_class
from vt.shared.models.lora import lora_weight_name
from vt.shared.video_io import read_sound
from vt.train.trackers import read_metrics

from helpers import HELPERS
from helpers.cli_runs import finish, raw_keys, start

pytestmark = pytest.mark.slow

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
# One config per kind of training state (what a checkpoint holds): a LoRA (demo; wan's LoRA under activation
# checkpointing is hunyuan_video's and wan22_a14b's state too), one expert of two, both experts (and image
# conditioning), a full fine-tune, two block lists, an audio-video transformer.
KILLED = {"demo", "wan22_a14b", "wan22_i2v_a14b", "wan22_ti2v_5b", "hunyuan_video", "ltx2"}
KILLED_EPOCHS = 2  # at most: an epoch boundary the run crosses, before or after the kill at step 4
SMALL_SIDE = 128  # buckets up to this size and 17 frames run as they are


def small_buckets(sizes: list[str], spec) -> list[str]:
    """The config's buckets at a size CPU tests afford: the same aspects, valid for the family."""
    g = spec.geometry
    unit = g.spatial * g.patch
    out: list[str] = []
    for bucket in parse_buckets(sizes):
        if max(bucket.height, bucket.width) <= SMALL_SIDE and bucket.frames <= 17:
            name = bucket.name
        else:
            longest = max(96, 3 * unit) // unit * unit
            scale = longest / max(bucket.height, bucket.width)
            height, width = (max(unit, round(side * scale / unit) * unit) for side in (bucket.height, bucket.width))
            name = f"{g.temporal + 1}x{height}x{width}"
        if name not in out:
            out.append(name)
    return out


def overrides(config_path: Path, tmp_path: Path, model: Path, raw: Path) -> list[str]:
    config = load_config(config_path, [f'model.path="{model}"'])
    spec = build_spec(config.model, config.buckets.fps)
    validation = config.validation
    sets = [
        f'model.path="{model}"',
        f'run.dir="{tmp_path / "run"}"',
        f'window.uri="{tmp_path / "window"}"',
        f'data.raw="{raw}"',
        f"buckets.sizes={json.dumps(small_buckets(config.buckets.sizes, spec))}",
        "window.poll_seconds=0.05",
        "window.timeout_seconds=300",
        f"precompute.workers={min(config.precompute.workers, 1)}",
        *(
            [
                "train.checkpoint_every=2",
                "validation.every=2",
                f"train.epochs={min(config.train.epochs, KILLED_EPOCHS)}",
            ]
            if config_path.stem in KILLED
            # one epoch, validated and checkpointed at the end only, without the base's videos: the killed configs
            # cover the intervals and the base's videos, made before the kill and reused by the resume
            else ["train.epochs=1", "train.checkpoint_every=1000", "validation.every=1000", "validation.base=false"]
        ),
        f"validation.steps={min(validation.steps, 2)}",
        "log.every_steps=1",
        "log.progress=false",
        "log.samples=true",
    ]
    if config.model.task in ("i2v", "flf2v") and validation.prompts:
        image = validation_image(tmp_path / "first_frame.png")
        sets.append(f"validation.images={json.dumps([str(image)] * len(validation.prompts))}")
    if config.model.task == "flf2v" and validation.prompts:
        last = validation_image(tmp_path / "last_frame.png", mirrored=True)
        sets.append(f"validation.last_images={json.dumps([str(last)] * len(validation.prompts))}")
    if spec.control_video and validation.prompts:
        control = validation_video(tmp_path / "control.mp4")
        sets.append(f"validation.videos={json.dumps([str(control)] * len(validation.prompts))}")
    return sets


def validation_video(path: Path) -> Path:
    """A 3 s, 24 fps, 96 x 64 control video (a bar sweeping left to right) for validation under a control video."""
    import numpy as np

    from vt.shared.video_io import write_video

    frames = np.zeros((72, 64, 96, 3), dtype=np.uint8)
    for index, frame in enumerate(frames):
        frame[:, index + 8 : index + 20] = 255
    return write_video(frames, path, fps=24.0)


def validation_image(path: Path, mirrored: bool = False) -> Path:
    """A 96 x 64 PNG (colour gradients) to condition i2v validation videos on (`mirrored`: left-right, a
    first-and-last-frame config's last frame)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:64, 0:96]
    pixels = np.stack([x * 255 // 95, y * 255 // 63, (x + y) * 255 // 158], axis=-1).astype(np.uint8)
    Image.fromarray(np.ascontiguousarray(pixels[:, ::-1]) if mirrored else pixels).save(path)
    return path


def trained(run_dir: Path) -> Counter:
    """(epoch, key) -> times trained; a step logged again after the resume replaces the killed run's."""
    steps: dict[int, list[dict]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        entry = json.loads(line)
        steps.setdefault(entry["step"], []).append(entry)
    return Counter((e["epoch"], key) for entries in steps.values() for e in entries for key in e["keys"])


@pytest.mark.parametrize(
    "config_path", [pytest.param(p, id=p.stem, marks=pytest.mark.xdist_group(f"config-{p.stem}")) for p in CONFIGS]
)  # one config a unit of work under pytest-xdist
def test_shipped_config_runs_both_stages(config_path, tmp_path, tiny_model_factory, raw_shards, request):
    model = load_config(config_path).model  # the preset of the config's family and task
    # A family that trains on a control video reads one per sample: the same pieces with their edge maps; a
    # run that trains sound reads them with a sound track.
    raw = request.getfixturevalue("control_shards") if get_spec_class(model.family).control_video else raw_shards
    raw = request.getfixturevalue("sound_shards") if model.audio else raw
    sets = overrides(config_path, tmp_path, tiny_model_factory(model.family, task=model.task), raw)
    config = load_config(config_path, sets)
    run_dir = config.run_dir
    logs = {name: tmp_path / f"{name}.log" for name in ("precompute", "killed", "train")}

    producer = start("precompute", config_path, *sets, log=logs["precompute"])
    videos = [f"{i:02d}.mp4" for i in range(len(config.validation.prompts))]
    if config_path.stem in KILLED:
        killed = start("train", config_path, *sets, log=logs["killed"], env={"VT_FAULT_AT": "train.after_checkpoint@2"})
        assert killed.wait(timeout=600) == -9, logs["killed"].read_text()[-3000:]
        assert (run_dir / "checkpoints" / "step-000004" / "state.json").is_file()
        if videos:  # the validation before the kill
            assert sorted(p.name for p in (run_dir / "validation" / "step-000002").glob("*.mp4")) == videos
    trainer = start("train", config_path, *sets, log=logs["train"])  # resumes after a kill
    finish(trainer, logs["train"], timeout=600)
    finish(producer, logs["precompute"], timeout=60)
    assert ("resumed from" in logs["train"].read_text()) == (config_path.stem in KILLED)

    epochs = config.train.epochs
    assert trained(run_dir) == Counter({(e, key): 1 for e in range(epochs) for key in raw_keys(raw)})
    metrics = {m["step"]: m for m in read_metrics(run_dir / "metrics.jsonl")}
    assert all(math.isfinite(m["loss"]) for m in metrics.values())
    if config.model.audio:
        assert all(math.isfinite(m["audio_loss"]) and 0 < m["audio_loss"] for m in metrics.values())
    warmup, lr = config.lr_schedule.warmup_steps, config.train.lr
    assert all(m["lr"] == pytest.approx(lr * min(1.0, step / warmup) if warmup else lr) for step, m in metrics.items())
    spec = build_spec(config.model, config.buckets.fps)
    buckets = {e["step"]: e["bucket"] for e in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())}
    for step, m in metrics.items():  # one bucket per step, logged every step: tokens / samples = tokens per sample
        tokens = spec.tokens_per_sample(spec.latent_shape(parse_buckets([buckets[step]])[0]))
        assert m["tokens_s"] / m["samples_s"] == pytest.approx(tokens)
    if config.train.mode == "lora":  # one file per expert when a run trains them all
        names = [lora_weight_name(expert) for expert in spec.trained_experts] or [lora_weight_name()]
        assert all((run_dir / "lora" / name).is_file() for name in names), names
    else:
        folders = [run_dir / "model" / component for component in spec.trained_experts.values()]
        assert all(folder.is_dir() for folder in folders or [run_dir / "model"]), folders
    if videos:
        rounds = sorted((run_dir / "validation").iterdir())  # every validate_every steps and at the end
        every = {"step-000002"} if config_path.stem in KILLED else set()  # the others validate at the end
        assert every | {f"step-{max(metrics):06d}"} <= {r.name for r in rounds}
        assert all(sorted(p.name for p in r.glob("*.mp4")) == videos for r in rounds)
        if config.model.audio:  # the sound the run trained, with the frames
            assert all(read_sound(p) is not None for r in rounds for p in r.glob("*.mp4"))
            assert all(math.isfinite(m["audio_loss"]) for m in metrics.values())


# Configs that parallel.pp = 2 refuses at start-up, with the words its message must carry.
PP_REFUSED = {
    "kandinsky5_lite": "its visual blocks take",
    "kandinsky5_pro_i2v": "its visual blocks take",
    "wan_vace": "its VACE blocks run on the control tokens",
    "ltx2": "set parallel.pp = 1 to train sound",
    "minimax_h3": "set parallel.pp = 1 to train sound",
    "wan22_i2v_a14b": "train one expert per run",
    "kandinsky6_lite": "its fused blocks take",
    "kandinsky6_pro_i2v": "its fused blocks take",
}


def test_shipped_configs_start_under_pipeline_parallel(tmp_path, tiny_model_factory):
    """Every config in configs/ under parallel.pp = 2 (two gloo ranks, one launch for all): it starts (the model
    laid out over the stages, validation prompts included), its transformer's forward run over the stages as
    validation runs it equals the same model's forward in one piece (1e-4 of its scale), and the stages' full-weight
    export is one process's file for file, byte for byte; or it is refused at start-up naming why."""
    from helpers.forkserver import launch_ranks

    jobs, transformers = [], {}
    for path in CONFIGS:
        model = load_config(path).model
        folder = tmp_path / path.stem
        folder.mkdir()
        sets = overrides(path, folder, tiny_model_factory(model.family, task=model.task), folder / "raw")
        config = load_config(path, sets)
        transformers[path.stem] = max(len(build_spec(config.model, config.buckets.fps).experts()), 1)
        jobs.append({"name": path.stem, "config": str(path), "sets": sets, "export": str(folder / "export")})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    log, out = tmp_path / "pp.log", tmp_path / "pp.json"
    ranks = launch_ranks(str(HELPERS / "pp_startup_worker.py"), 2, str(tmp_path / "jobs.json"), str(out), log=log)
    finish(ranks, log, timeout=600)
    results = json.loads(out.read_text())
    assert set(results) == {p.stem for p in CONFIGS}
    for name, result in results.items():
        if name in PP_REFUSED:
            assert "parallel.pp" in result.get("refused", "") and PP_REFUSED[name] in result["refused"], (name, result)
            continue
        assert result.get("started"), (name, result)
        assert result["finite"] and result["max_diff"] <= 1e-4 * max(result["scale"], 1.0), (name, result)
        assert result["models"] == transformers[name], (name, result)  # a one-expert run's other expert too
        # The full-weight export of the stages (each tensor streamed from its stage) is one process's, byte for byte.
        exported = {
            side: {p.name: p.read_bytes() for p in (tmp_path / name / "export" / side).iterdir()}
            for side in ("pp", "one")
        }
        assert len(exported["one"]) > 2 and exported["pp"] == exported["one"], name  # config, index, several files
