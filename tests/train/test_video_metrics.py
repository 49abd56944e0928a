"""The validation videos' metrics ([metrics], vt.train.video_metrics) on inputs whose answer is known, with the tiny
metric models (real transformers classes, random weights; tests/conftest.py `tiny_metric_models`), and the whole path
through `vt-train run` with every metric on.

Random weights cannot say whether a video matches its prompt or whether a track is speech: the prompt and sound
scores are checked against the library's own forward (CLIPModel's logits are its cosine times its scale), and the
metrics whose answer follows from the input alone (a still video, a render equal to a training clip, a shuffled
order, a click train k frames late) are checked for that answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import Config
from vt.shared.errors import UserError
from vt.shared.video_io import Sound, read_fitted, write_video
from vt.train.parts import Parts
from vt.train.video_metrics import Scorer, Video, VideoMetrics
from vt.train.video_metrics.media import read_clip
from vt.train.video_metrics.models import Encoder
from vt.train.video_metrics.motion import motion
from vt.train.video_metrics.prompt import prompt_score
from vt.train.video_metrics.sound import audio_prompt, av_offset_ms

FPS = 8.0
BUCKET = Bucket(17, 64, 96)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def clips(clips_dir, tmp_path_factory):
    """Real clips fitted to BUCKET at FPS and written as validation writes its videos: a training clip
    (train/bikes.mp4), a held-out one (held/bunny.mp4), a still video of the training clip's first frame and the
    training clip's frames in a shuffled order."""
    root = tmp_path_factory.mktemp("metric-clips")
    bikes = read_fitted(clips_dir / "bikes.mp4", BUCKET, FPS)
    bunny = read_fitted(clips_dir / "bigbuckbunny.mp4", BUCKET, FPS)
    write_video(bikes, root / "train" / "bikes.mp4", fps=FPS)
    write_video(bunny, root / "held" / "bunny.mp4", fps=FPS)
    write_video(np.repeat(bikes[:1], BUCKET.frames, axis=0), root / "still.mp4", fps=FPS)
    write_video(bikes[np.random.default_rng(0).permutation(BUCKET.frames)], root / "shuffled.mp4", fps=FPS)
    return root


def metrics_config(models, clips, **values) -> Config:
    settings = {
        "clip": str(models["clip"]),
        "likeness": str(models["dinov2"]),
        "flow": "opencv",
        "reference": [str(clips / "train")],
        "reference_held_out": [str(clips / "held")],
        **values,
    }
    return Config.model_validate({"metrics": settings, "validation": {"prompts": ["people riding bikes"]}})


def score(scorer: Scorer, path) -> dict[str, float]:
    return {key.split("/")[1]: value for key, value in scorer.score(Video(5, 0, path, "people riding bikes")).items()}


def test_still_equal_and_shuffled_videos_score_as_their_frames_say(tiny_metric_models, clips, tmp_path):
    """A render equal to a training clip: likeness 1 and the motion of the training clip (ratio 1), the held-out
    likeness lower; a still video: consistency 1 and no motion; the shuffled frames: less consistent."""
    scorer = Scorer(metrics_config(tiny_metric_models, clips).metrics, FPS, CPU)
    render = shutil.copy(clips / "train" / "bikes.mp4", tmp_path / "00.mp4")
    equal, still, shuffled = (
        score(scorer, render),
        score(scorer, clips / "still.mp4"),
        score(scorer, clips / "shuffled.mp4"),
    )
    assert equal["likeness"] == pytest.approx(1.0, abs=1e-6)
    assert equal["likeness_held_out"] < 0.95
    assert equal["motion_ratio"] == 1.0 and equal["motion"] > 1.0  # pixels a frame at 64 x 96
    assert score(scorer, clips / "held" / "bunny.mp4")["likeness_held_out"] == pytest.approx(1.0, abs=1e-6)

    assert still["consistency"] == pytest.approx(1.0, abs=1e-6)
    # h264 refines a still picture over its P-frames: a few thousandths of a pixel; the frames themselves: none
    assert still["motion"] < 0.01 and still["motion_ratio"] < 0.01
    frames = read_clip(clips / "still.mp4", FPS).frames
    assert motion(np.repeat(frames[:1], 5, axis=0), "opencv") == motion(frames[:1].repeat(5, 0), "difference") == 0.0

    assert shuffled["consistency"] < equal["consistency"] - 0.05
    assert shuffled["motion"] > equal["motion"]  # jumps between unrelated frames


def test_prompt_and_sound_scores_are_the_checkpoints_own_cosines(tiny_metric_models, clips):
    """CLIP's and SigLIP's prompt scores and CLAP's sound score equal the cosine each model's own forward computes
    (its logits over its logit scale, less SigLIP's bias). Random weights say nothing of meaning: a tone and a silent
    track only score differently."""
    frames = read_clip(clips / "train" / "bikes.mp4", FPS).frames
    prompt = "people riding bikes"
    for name in ("clip", "siglip"):
        encoder = Encoder("clip", str(tiny_metric_models[name]), CPU)
        inputs = encoder.processor(text=[prompt], images=list(frames), padding=encoder.padding, return_tensors="pt")
        with torch.no_grad():
            out = encoder.model(**inputs)
            logits = out.logits_per_image[:, 0] - (encoder.model.logit_bias if name == "siglip" else 0)
            expected = float((logits / encoder.model.logit_scale.exp()).mean())
        assert prompt_score(encoder, frames, prompt, BUCKET.frames) == pytest.approx(expected, abs=1e-5)
    assert inputs["input_ids"].shape[1] == 64  # SigLIP: padded to the tokenizer's length, as it was trained

    clap = Encoder("clap", str(tiny_metric_models["clap"]), CPU)
    tone = Sound(0.5 * np.sin(2 * np.pi * 440 * np.arange(32000) / 16000)[None].astype(np.float32), 16000)
    silence = Sound(np.zeros((2, 32000), np.float32), 16000)
    scores = [audio_prompt(clap, sound, "a tone") for sound in (tone, silence)]
    inputs = clap.processor(
        text=["a tone"], audio=[np.zeros(96000, np.float32)], sampling_rate=48000, return_tensors="pt"
    )
    with torch.no_grad():
        expected = float(clap.model(**inputs).logits_per_audio[0, 0] / clap.model.logit_scale_a.exp())
    assert scores[1] == pytest.approx(expected, abs=1e-5)  # the silence, repeated to CLAP's 10 s as its extractor pads
    assert abs(scores[0] - scores[1]) > 1e-3 and all(-1 <= s <= 1 for s in scores)


def flashes_and_clicks(lag: int, frames: int = 33, rate: int = 16000) -> tuple[np.ndarray, Sound]:
    """A picture that switches between dark and light at irregular frames, and a click train `lag` frames after each
    switch (before it for a negative lag)."""
    switches = [3, 7, 8, 14, 20, 25]
    light = np.cumsum(np.isin(np.arange(frames), switches)) % 2
    video = np.where(light[:, None, None, None], 220, 30).astype(np.uint8) * np.ones((1, 64, 64, 3), np.uint8)
    wave = np.zeros((1, round(frames * rate / FPS)), np.float32)
    for frame in (s + lag for s in switches if 0 < s + lag < frames):
        start = round(frame * rate / FPS)
        wave[0, start : start + 32] = 0.8
    return video, Sound(wave, rate)


@pytest.mark.parametrize("lag", [-2, 0, 3])
def test_a_click_train_k_frames_late_is_k_frames_of_offset(lag, tmp_path):
    """The offset is the lag in ms (k x 1000 / fps), through an mp4 with an AAC track as validation writes it;
    undefined (None, not logged) for a silent track and for a still picture."""
    video, sound = flashes_and_clicks(lag)
    assert av_offset_ms(video, sound, FPS) == lag * 1000 / FPS
    clip = read_clip(write_video(video, tmp_path / "00.mp4", fps=FPS, sound=sound), FPS)
    assert av_offset_ms(clip.frames, clip.sound, FPS) == lag * 1000 / FPS
    assert av_offset_ms(video, Sound(np.zeros_like(sound.waveform), sound.sample_rate), FPS) is None
    assert av_offset_ms(np.repeat(video[:1], len(video), axis=0), sound, FPS) is None


def test_the_worker_scores_beside_the_caller_and_raises_its_failure_at_the_next_call(
    tiny_metric_models, clips, tmp_path
):
    """Records come back under the video's step and prompt (another kind of render under its kind); a checkpoint that
    does not load fails on the thread and is raised, naming its key, by the next call."""
    settings = metrics_config(tiny_metric_models, clips, likeness=None, reference_held_out=[]).metrics
    worker = VideoMetrics(Scorer(settings, FPS, CPU))
    assert worker.done() == [] and worker.thread is None  # a rank that writes no video starts nothing
    worker.submit(7, 2, clips / "still.mp4", "a bike")
    worker.submit(7, 2, clips / "still.mp4", "a bike", kind="base")
    (step, lora), (_, base) = worker.finish()
    assert step == 7 and set(lora) == {f"val/{m}/02" for m in ("prompt", "consistency", "motion", "motion_ratio")}
    assert base == {key.replace("val/", "val/base/"): value for key, value in lora.items()}
    assert worker.thread is None

    broken = VideoMetrics(
        Scorer(metrics_config({**tiny_metric_models, "clip": tmp_path / "nothing"}, clips).metrics, FPS, CPU)
    )
    broken.submit(1, 0, clips / "still.mp4", "a bike")
    with pytest.raises(UserError, match="metrics.clip = .*nothing.*cannot load"):
        broken.finish()


def test_settings_that_cannot_work_are_refused_before_anything_is_built(tiny_metric_models, clips, tmp_path):
    def check(**values):
        config = metrics_config(tiny_metric_models, clips, **values)
        part = Parts(config)["metrics"]
        part.check(None, 1)
        part.check_machine(CPU)

    check()
    with pytest.raises(UserError, match="metrics.reference to them"):
        check(reference=[])
    with pytest.raises(UserError, match=r"metrics.clap .*model.audio = false"):
        check(clap=str(tiny_metric_models["clap"]))
    with pytest.raises(UserError, match=r"metrics.reference_held_out: .*nowhere.* is neither"):
        check(reference_held_out=[str(tmp_path / "nowhere")])
    with pytest.raises(UserError, match="no video files there"):
        check(reference=[str(tmp_path)])
    with pytest.raises(UserError, match="metrics.likeness = .* neither a checkpoint folder nor a hub id"):
        check(likeness=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="metrics.clip = 'nobody/nothing' is not in the Hugging Face cache"):
        check(clip="nobody/nothing")  # the suite runs with HF_HUB_OFFLINE=1
    assert "metrics" not in Parts(Config()).names()  # off while no model or method is named


def test_every_metric_through_vt_train_run(tiny_model_factory, tiny_metric_models, clips_dir, tmp_path):
    """LTX-2 with sound, one step and its validation video, every metric on, `vt-train run` in this process: each
    metric of the video is in metrics.jsonl under the validation's step, with the prompts' mean and the base's video's
    under step 0, and on the run page; keep_best ranks by one, with the weights its video was rendered with."""
    from make_sample_shards import make_sample_shards
    from typer.testing import CliRunner

    from vt.precompute.service import Precompute
    from vt.shared.config import load_config
    from vt.train.cli import app
    from vt.train.trackers import read_metrics

    from helpers.cli_runs import write_config

    raw = tmp_path / "raw"  # two 1.5 s pieces with a tone: one batch
    make_sample_shards([clips_dir / "carphone_pristine.mp4"], raw, max_side=128, sound="tone")
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-2"),
        raw,
        tmp_path / "run",
        str(tmp_path / "window"),
        model={"family": "ltx-2", "max_text_tokens": 16, "audio": True},
        buckets={"sizes": ["9x64x64"], "fps": FPS},
        window={"size": "keep"},
        precompute={"workers": 0},
        train={"max_steps": 1, "checkpoint_every": 0},
        validation={"prompts": ["a tone over a rabbit"], "steps": 2},
        metrics={
            "clip": str(tiny_metric_models["siglip"]),
            "likeness": str(tiny_metric_models["dinov2"]),
            "flow": "opencv",
            "clap": str(tiny_metric_models["clap"]),
            "av_offset": True,
            "reference": [str(clips_dir / "bikes.mp4")],
            "reference_held_out": [str(clips_dir / "carphone_pristine.mp4")],
        },
        keep_best={"count": 1, "by": "val/likeness", "goal": "max"},
    )
    Precompute(load_config(config)).run()
    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 0, result.output

    logged = {k: v for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1 for k, v in r.items()}
    names = ("prompt", "consistency", "likeness", "likeness_held_out", "motion", "motion_ratio", "audio_prompt")
    assert {f"val/{name}/00" for name in (*names, "av_offset_ms")} <= set(logged), sorted(logged)
    assert all(-1 <= logged[f"val/{name}/00"] <= 1 for name in ("prompt", "consistency", "likeness", "audio_prompt"))
    assert logged["val/av_offset_ms/00"] % (1000 / FPS) == 0 and logged["loss"] > 0
    assert logged["val/likeness"] == logged["val/likeness/00"]  # the mean over the (one) prompt
    base = {k: v for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 0 for k, v in r.items()}
    assert {"val/base/likeness/00", "val/base/prompt/00", "val/base/likeness"} <= set(base), sorted(base)
    # ranked by a metric that came after the step's export was made at its validation
    kept = json.loads((tmp_path / "run" / "keep_best.json").read_text())
    assert kept["kept"] == [1] and kept["scores"] == {"1": logged["val/likeness"]}
    assert any((tmp_path / "run" / "exports" / "step-000001").rglob("*.safetensors"))
    assert "validation videos: likeness_held_out" in (tmp_path / "run" / "report.html").read_text()


def test_a_prompts_mean_is_logged_once_every_prompt_of_its_step_is_in():
    """Records come as each video is scored, across validations: the mean of a step's metric waits for every prompt."""
    from vt.train.parts.video_metrics import prompt_means, video_of

    waiting: dict = {}
    first = prompt_means([(2, {"val/motion/00": 1.0, "val/base/motion/00": 4.0})], 2, waiting)
    assert first == [(2, {"val/motion/00": 1.0, "val/base/motion/00": 4.0})]  # prompt 01 of step 2 not in yet
    later = prompt_means([(2, {"val/motion/01": 3.0}), (4, {"val/motion/00": 5.0})], 2, waiting)
    assert later[-1] == (2, {"val/motion": 2.0}) and list(waiting) == [(2, "val/base/motion"), (4, "val/motion")]
    assert video_of(Path("validation/base/01.mp4")) == (1, "base")
    assert video_of(Path("validation/base/01-stacked.mp4")) == (1, "base_stacked")
    assert video_of(Path("validation/step-000004/01-stacked.mp4")) == (1, "stacked")
