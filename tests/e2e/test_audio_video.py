"""Sound with the picture through both stages: real clips with a tone muxed in, and clips without a sound
track, run as a user runs them (both CLIs as processes) on the tiny presets of LTX-2 and Kandinsky 6 with
model.audio."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest

from vt.precompute.sources import list_raw_shards
from vt.shared.shards import decode_shard
from vt.shared.video_io import read_sound, read_video
from vt.shared.window import open_reader
from vt.train.trackers import read_metrics

from helpers.cli_runs import finish, raw_keys, start, write_config

pytestmark = pytest.mark.slow

EPOCHS = 6
# family -> (stored audio_latents per sample for 9 frames at 8 fps, the validation track's channels and rate)
FAMILIES = {
    "ltx-2": ((2, 28, 2), 2, 16000),  # 1.125 s of mel frames x bins
    "kandinsky6": ((4, 71), 1, 8000),
}  # ceil(1.125 s x 8000 / 128) MMAudio latents, mono


@pytest.fixture(scope="module")
def mixed_raw(sound_shards, raw_shards, tmp_path_factory):
    """The tone-muxed pieces and one shard of the same kind of pieces without sound, in one folder:
    (folder, keys with sound, keys without)."""
    folder = tmp_path_factory.mktemp("raw-mixed")
    for shard in list_raw_shards(str(sound_shards))[:2]:
        shutil.copy(shard, folder / f"sound-{shard.rsplit('/', 1)[-1]}")
    silent = list_raw_shards(str(raw_shards))[0]
    shutil.copy(silent, folder / f"silent-{silent.rsplit('/', 1)[-1]}")
    keys = raw_keys(folder)
    return folder, {k for k in keys if k.startswith("sound-")}, {k for k in keys if k.startswith("silent-")}


@pytest.mark.parametrize("family", FAMILIES)
def test_audio_trains_with_the_video_through_both_stages(mixed_raw, tiny_model_factory, tmp_path, family):
    """The shards hold audio latents beside the latents; every silent clip is in rejects.jsonl once
    (`missing_audio`); the audio loss falls over epochs of the same clips; the validation mp4 carries a
    sound track as long as its frames."""
    raw, heard, silent = mixed_raw
    window_uri = str(tmp_path / "window")
    config = write_config(
        tmp_path / "audio.toml",
        tiny_model_factory(family),
        raw,
        tmp_path / "run",
        window_uri,
        model={"family": family, "max_text_tokens": 16, "audio": True},
        buckets={"sizes": ["9x64x64"], "fps": 8.0},
        window={"size": "keep"},
        precompute={"samples_per_shard": 4, "encode_batch": 2, "workers": 1},
        train={
            "batch_size": 2,
            "lr": 3e-3,
            "epochs": EPOCHS,
        },
        validation={"prompts": ["a tone over a rabbit"], "steps": 2},
    )
    logs = {stage: tmp_path / f"{stage}.log" for stage in ("precompute", "train")}
    procs = {stage: start(stage, config, log=logs[stage]) for stage in ("precompute", "train")}
    for stage, proc in procs.items():
        finish(proc, logs[stage], timeout=600)

    rejects = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in rejects) == sorted(silent)  # each once, though the data is read 6 times
    assert {r["reason"] for r in rejects} == {"missing_audio"}

    window = open_reader(window_uri)
    stored = {}
    for _, record in window.order():
        tensors, keys, _ = decode_shard(window.read_shard(record))
        assert tensors["audio_latents"].shape[0] == tensors["latents"].shape[0] == len(keys)
        stored.update({key: tuple(tensors["audio_latents"][i].shape) for i, key in enumerate(keys)})
    shape, channels, rate = FAMILIES[family]
    assert set(stored) == heard and set(stored.values()) == {shape}

    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps_per_epoch = len(metrics) // EPOCHS
    assert steps_per_epoch >= 1 and all("audio_loss" in m for m in metrics)
    audio = [m["audio_loss"] for m in sorted(metrics, key=lambda m: m["step"])]
    first = statistics.median(audio[: 2 * steps_per_epoch])
    last = statistics.median(audio[-2 * steps_per_epoch :])
    assert last < 0.8 * first, audio

    (video,) = sorted((tmp_path / "run" / "validation").glob("step-*/*.mp4"))
    frames, sound = read_video(video), read_sound(video)
    assert sound is not None and sound.waveform.shape[0] == channels and sound.sample_rate == rate
    seconds = frames.shape[0] / 8.0
    assert abs(sound.waveform.shape[1] / sound.sample_rate - seconds) < 0.15, (sound.waveform.shape, seconds)
