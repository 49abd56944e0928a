"""Validation on the training model itself, with no text encoder: under FSDP2 every rank renders its own
prompts from conditions stage 1 stored in the window, under pipeline parallel the two stages render every prompt
together (each denoising step's transformer call runs over both), and the videos are the ones one process renders: the
trained LoRA's, and the base's (validation.base: the adapters switched off on every rank alike)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vt.train.trackers import read_metrics

from helpers import HELPERS
from helpers.dist_runs import finish, single, torchrun
from helpers.forkserver import launch

PROMPTS = ["a cartoon rabbit in a green meadow", "people riding bikes down a street", "a phone call in an office"]


def first_frames(clips_dir: Path, out: Path) -> list[str]:
    """One 64 x 64 PNG per prompt, the first frame of a real clip (i2v conditioning images)."""
    import av

    paths = []
    for index, clip in enumerate(sorted(clips_dir.glob("*.mp4"))[: len(PROMPTS)]):
        with av.open(str(clip)) as container:
            image = next(container.decode(video=0)).to_image().resize((64, 64))
        paths.append(str(out / f"image{index}.png"))
        image.save(paths[-1])
    return paths


def test_fsdp_validation_renders_every_prompt_from_the_window_without_text_encoders(
    tmp_path, run_config, clips_dir, tiny_metric_models
):
    """Wan 2.1 i2v: a text encoder, an image encoder and a negative prompt (classifier-free guidance),
    three prompts over two ranks (rank 1 renders a stand-in in the second round)."""
    from vt.shared.video_io import read_video

    images = first_frames(clips_dir, tmp_path)
    config = run_config(
        tmp_path,
        "wan-i2v",
        "validate",
        validation={"prompts": PROMPTS, "images": images, "steps": 2},
        # every video metric of a family without sound, each scored on the rank that wrote the video (the sound ones,
        # clap and av_offset, are scored alike: tests/train/test_video_metrics.py runs them in one process)
        metrics={
            "clip": str(tiny_metric_models["siglip"]),
            "likeness": str(tiny_metric_models["dinov2"]),
            "flow": "difference",
            "reference": [str(clips_dir / "bikes.mp4")],
        },
        max_steps=1,
        checkpoint_every=0,
    )

    # The window was made without these prompts: the trainer stops before its first step and says how to add them.
    log = tmp_path / "missing.log"
    assert single(config, log=log).wait(timeout=300) != 0
    assert "vt-precompute prompts" in log.read_text() and PROMPTS[0] in log.read_text()

    # The command that adds them (it loads the text and image encoders only), forked from the warm interpreter.
    log = tmp_path / "prompts.log"
    finish(launch("vt-precompute", "prompts", str(config), log=log), log)
    assert "7 inputs encoded" in log.read_text()  # 3 prompts, the negative prompt "", 3 images

    built = tmp_path / "built"
    log = tmp_path / "fsdp.log"
    finish(
        torchrun(
            config,
            2,
            "run.dir=" + str(tmp_path / "fsdp"),
            "parallel.dp_shard=-1",
            log=log,
            script=HELPERS / "record_models.py",
            env={"VT_BUILT_MODELS": str(built)},
        ),
        log,
    )
    for rank in (0, 1):
        # the transformer and the VAE, then the metric models (one SigLIP for prompts, one DINOv2 for likeness): never
        # the text or image encoders, whose conditions stage 1 stored
        assert json.loads(Path(f"{built}.{rank}").read_text()) == [
            "WanTransformer3DModel",
            "AutoencoderKLWan",
            *("SiglipModel", "SiglipTextModel", "SiglipVisionModel", "Dinov2Model", "Dinov2Encoder"),
        ], f"rank {rank} built other models than the transformer, the VAE and the metric models"
    log = tmp_path / "pp.log"
    finish(torchrun(config, 2, "run.dir=" + str(tmp_path / "pp"), "parallel.pp=2", "parallel.dp_shard=1", log=log), log)
    log = tmp_path / "single.log"
    finish(single(config, log=log), log)
    for index in range(len(PROMPTS)):
        for folder in ("step-000001", "base"):  # the trained LoRA's videos, and the base's (its adapters off)
            alone = read_video(tmp_path / "validate" / "validation" / folder / f"{index:02d}.mp4").astype(int)
            assert alone.shape == (9, 64, 64, 3)
            for layout in ("fsdp", "pp"):
                video = read_video(tmp_path / layout / "validation" / folder / f"{index:02d}.mp4").astype(int)
                assert video.shape == alone.shape
                difference = np.abs(video - alone).mean()
                print(f"{layout} {folder} prompt {index}: mean |difference| {difference:.4f} of 255")
                assert difference < 0.5, f"prompt {index}: {layout} validation ({folder}) differs from one process"
    for layout in ("fsdp", "pp"):  # one writer per data-parallel group: each prompt's video once
        assert sorted(p.name for p in (tmp_path / layout / "validation" / "step-000001").iterdir()) == [
            f"{index:02d}.mp4" for index in range(len(PROMPTS))
        ]
    # Each video's metric reached rank 0's metrics.jsonl, whichever rank wrote it (rank 1 wrote prompt 1's under
    # FSDP2), the base's under step 0, with the prompts' mean; one process scores the same videos alike.
    names = ("prompt", "consistency", "likeness", "motion", "motion_ratio")
    wanted = {f"val/{name}/{i:02d}" for name in names for i in range(len(PROMPTS))} | {f"val/{name}" for name in names}
    logged = {}
    for layout in ("fsdp", "pp", "validate"):
        logged[layout] = {
            (r["step"], k): v for r in read_metrics(tmp_path / layout / "metrics.jsonl") for k, v in r.items()
        }
        expected = {(1, key) for key in wanted} | {(0, key.replace("val/", "val/base/")) for key in wanted}
        assert expected <= set(logged[layout]), sorted(expected - set(logged[layout]))
    for layout in ("fsdp", "pp"):  # the same videos (within half a level of 255), so about the same scores
        for key in ("val/prompt", "val/likeness", "val/consistency"):
            assert abs(logged[layout][(1, key)] - logged["validate"][(1, key)]) < 0.02, (layout, key)


def test_fsdp_scores_the_sound_metrics_of_every_prompt_as_one_process_does(tmp_path, run_config, tiny_metric_models):
    """LTX-2 with sound under FSDP2 over 2 ranks: CLAP's audio-text agreement and the audio-video offset of each
    prompt's video (rank 1 writes prompt 1's) reach rank 0's metrics.jsonl, and score as one process scores them."""
    config = run_config(
        tmp_path,
        "ltx-2-audio",
        "sound",
        validation={"prompts": PROMPTS[:2], "steps": 2, "base": False},
        metrics={"clap": str(tiny_metric_models["clap"]), "av_offset": True},
        max_steps=1,
        checkpoint_every=0,
    )
    log = tmp_path / "prompts.log"
    finish(launch("vt-precompute", "prompts", str(config), log=log), log)
    log = tmp_path / "fsdp.log"
    finish(torchrun(config, 2, "run.dir=" + str(tmp_path / "fsdp"), "parallel.dp_shard=-1", log=log), log)
    log = tmp_path / "single.log"
    finish(single(config, log=log), log)
    wanted = {f"val/{name}/{i:02d}" for name in ("audio_prompt", "av_offset_ms") for i in range(2)}
    logged = {}
    for layout in ("fsdp", "sound"):
        logged[layout] = {
            k: v for r in read_metrics(tmp_path / layout / "metrics.jsonl") if r["step"] == 1 for k, v in r.items()
        }
        assert wanted <= set(logged[layout]), (layout, sorted(logged[layout]))
    for key in wanted:
        assert abs(logged["fsdp"][key] - logged["sound"][key]) < (0.02 if "audio_prompt" in key else 1e-6), key
