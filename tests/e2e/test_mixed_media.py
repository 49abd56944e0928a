"""Still images and clips in one run: one-frame and video buckets through both stages, caption dropout.

The raw input is a folder of real mp4 pieces and .jpg / .png / .webp stills cut from the same clips
(the `media_folder` fixture), read as a folder and, for the image-only run, after `pack` into tars.
Both stages run in this process to keep the test short.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from vt.precompute.pack import pack_folder
from vt.precompute.service import Precompute
from vt.shared.caption_table import decode_caption
from vt.shared.config import load_config
from vt.shared.window import open_reader
from vt.train.data import BatchReader
from vt.train.parts.caption_dropout import dropped
from vt.train.trackers import read_metrics
from vt.train.trainer import Trainer

from helpers.cli_runs import write_config

pytestmark = pytest.mark.slow

VIDEO_BUCKETS, IMAGE_BUCKETS = ["9x64x96", "9x64x64"], ["1x64x96", "1x64x64"]


def run_both_stages(tmp_path, model, raw, buckets, rate: float = 0.0, max_steps: int = 0):
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            model,
            raw,
            tmp_path / "run",
            str(tmp_path / "window"),
            buckets={"sizes": buckets},
            window={"size": "keep"},
            precompute={"workers": 0},
            train={"batch_size": 2, "max_steps": max_steps},
            caption_dropout={"rate": rate},
            log={"samples": True, "progress": False},
        )
    )
    report = Precompute(config).run()
    trainer = Trainer(config)
    summary = trainer.run()
    steps = [json.loads(line) for line in (config.run_dir / "samples.jsonl").read_text().splitlines()]
    return config, report, trainer, summary, steps


def test_images_and_videos_train_in_one_run_with_caption_dropout(tmp_path, tiny_model_factory, media_folder):
    config, report, trainer, summary, steps = run_both_stages(
        tmp_path, tiny_model_factory("ltx-video"), media_folder, VIDEO_BUCKETS + IMAGE_BUCKETS, rate=0.5
    )

    media = [p for p in media_folder.iterdir() if p.suffix != ".txt"]
    assert report.committed == len(media) and not report.rejected
    buckets = {step["bucket"] for step in steps}
    assert buckets & set(IMAGE_BUCKETS) and buckets & set(VIDEO_BUCKETS)
    stills = {key for step in steps if step["bucket"].startswith("1x") for key in step["keys"]}
    assert stills == {p.stem for p in media if "still" in p.stem}  # every image, as a one-frame sample
    assert all(math.isfinite(m["loss"]) for m in read_metrics(config.run_dir / "metrics.jsonl"))
    assert summary["steps"] == len(steps)

    # Caption dropout: the samples `dropped` names get exactly the window's empty caption, the others keep theirs.
    window = open_reader(config.window.uri)
    empty = decode_caption(window.empty_caption(trainer.fingerprint))
    batch = next(iter(BatchReader(window, 2, on_read=lambda position: None)))
    step = next(s for s in range(100) if [dropped(0, s, i, 0.5) for i in range(2)] == [True, False])
    out = trainer.parts["caption_dropout"].batch(batch, 0, step).tensors
    assert set(empty) == {"prompt_embeds", "prompt_attention_mask"}
    for name, value in empty.items():
        assert torch.equal(out[name][0], value.float()) and torch.equal(out[name][1], batch.tensors[name][1])
        assert not torch.equal(batch.tensors[name][0], value.float())
    assert torch.equal(out["latents"], batch.tensors["latents"])


def test_an_image_only_run_from_packed_tars(tmp_path, tiny_model_factory, media_folder):
    total = sum(p.stat().st_size for p in media_folder.iterdir())
    tars = pack_folder(str(media_folder), str(tmp_path / "packed"), shard_bytes=total // 3)
    assert len(tars) > 1
    config, report, _, summary, steps = run_both_stages(
        tmp_path, tiny_model_factory("ltx-video"), tmp_path / "packed", IMAGE_BUCKETS, max_steps=2
    )

    stills = [p for p in media_folder.iterdir() if "still" in p.stem and p.suffix != ".txt"]
    assert report.committed == len(stills)
    assert report.rejected == {"no_bucket": len(list(media_folder.glob("*.mp4")))}  # clips need a video bucket
    assert summary["steps"] == 2 and {s["bucket"] for s in steps} <= set(IMAGE_BUCKETS)
