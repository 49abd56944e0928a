"""Stage 1 hears (model.audio): each clip's sound over exactly its sampled frames' time span, resampled to the
family's rate and channels, encoded by the family and stored as `audio_latents` beside the latents under
the same keys; clips without sound follow data.missing_audio, a broken track is a reject, the settings are
part of the fingerprint, and without model.audio nothing of it happens. Real clips (pieces of the sample
clips with a tone or noise muxed in by scripts/make_sample_shards.py), real PyAV, the tiny LTX-2 preset."""

from __future__ import annotations

import io
import json
import shutil
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from make_sample_shards import cut_clip, with_sound

from vt.precompute.processors import Clip, SampleError, SoundRequest, build_chain, decode_sound
from vt.precompute.service import Precompute
from vt.precompute.sources import RawSample, iter_raw_samples, list_raw_shards, shard_names
from vt.shared.buckets import Bucket, parse_buckets
from vt.shared.config import load_config
from vt.shared.provenance import fingerprint, provenance
from vt.shared.shards import decode_shard
from vt.shared.window import open_reader

from helpers.cli_runs import write_config

STEREO_16K = SoundRequest(16000, 2, "skip")
SIZES = ["9x32x64", "9x32x32", "9x64x32"]


def clip_with_sound(
    wave: np.ndarray,
    rate: int,
    seconds: float = 4.0,
    fps: int = 8,
    layout: str = "stereo",
    video_start: int = 0,
    container_format: str = "mp4",
) -> bytes:
    """An mp4 (or `container_format`) of gray frames (`seconds` at `fps`, a keyframe a second) with `wave`
    (channels, samples) as its AAC track; `video_start`: the first frame's pts (in 1/fps), so the video starts
    after the sound."""
    out = io.BytesIO()
    with av.open(out, mode="w", format=container_format) as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        video.codec_context.gop_size = fps
        audio = container.add_stream("aac", rate=rate, layout=layout)
        for index in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 90, np.uint8), format="rgb24")
            frame.pts, frame.time_base = video_start + index, Fraction(1, fps)
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if wave.shape[1]:  # else an audio stream without a frame
            sound = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(wave, dtype=np.float32), format="fltp", layout=layout
            )
            sound.sample_rate, sound.pts = rate, 0
            container.mux(audio.encode(sound))
            container.mux(audio.encode(None))
    return out.getvalue()


def step_wave(rate: int, seconds: float, at: float, channels: int = 2) -> np.ndarray:
    """Silence, then from `at` seconds a 1 kHz tone of amplitude 0.5."""
    t = np.arange(round(seconds * rate)) / rate
    wave = np.where(t >= at, 0.5 * np.sin(2 * np.pi * 1000 * t), 0.0)
    return np.repeat(wave[None], channels, axis=0)


def onset(sound: torch.Tensor, rate: int = 16000) -> float:
    """Seconds into `sound` where it first gets loud."""
    loud = (sound.abs().amax(0) > 0.1).nonzero()
    return float(loud[0]) / rate if len(loud) else float("inf")


def test_the_sound_is_cut_at_the_frames_time_span_and_resampled():
    """A 44.1 kHz stereo track that starts sounding at 3.0 s: 2 s spans starting at 1.5 s and (seeking) 2.5 s
    and 3.5 s hear it start where the frames say (1.5 s in, 0.5 s in, from the first sample), 16 kHz stereo
    of exactly the span's length; a mono track fills both channels of a stereo family alike and a mono
    family gets one."""
    clip = clip_with_sound(step_wave(44100, 6.0, 3.0), 44100, seconds=6.0)
    for begin, expected in ((1.5, 1.5), (2.5, 0.5), (3.5, 0.0)):
        sound = decode_sound(clip, begin, 2.0, STEREO_16K)
        assert sound.shape == (2, 32000) and sound.dtype == torch.float32
        assert abs(onset(sound) - expected) < 0.03, (begin, onset(sound))
    assert float(sound.abs().max()) == pytest.approx(0.5, abs=0.05)
    mono = clip_with_sound(step_wave(22050, 4.0, 1.0, channels=1), 22050, layout="mono")
    both = decode_sound(mono, 0.5, 1.0, STEREO_16K)
    assert both.shape == (2, 16000) and torch.equal(both[0], both[1]) and abs(onset(both) - 0.5) < 0.03
    assert float(both.abs().max()) == pytest.approx(0.5, abs=0.05)  # not FFmpeg's -3 dB upmix
    assert decode_sound(mono, 0.5, 1.0, SoundRequest(16000, 1)).shape == (1, 16000)


def test_frames_and_sound_stay_in_sync_when_the_video_starts_late():
    """A video stream whose first frame is at 1.0 s on the container's timeline: the clip's time 0 is there,
    so a sample of its first frames hears the sound from 1.0 s (the chain passes the clip's origin)."""
    clip = clip_with_sound(step_wave(16000, 5.0, 1.5), 16000, video_start=8)
    with Clip(clip) as opened:
        assert opened.origin_seconds == 1.0
    raw = RawSample(key="late", shard="s.tar", video=clip, caption="gray")
    (prepared,) = build_chain([]).prepare(raw, [Bucket(9, 32, 64)], 8.0, sound=STEREO_16K)
    assert prepared.sound.shape == (2, 18000) and abs(onset(prepared.sound) - 0.5) < 0.03


def test_missing_and_broken_sound_tracks_are_rejects(media):
    """No audio stream, or one without a frame: `missing_audio` under "skip", 16 kHz silence under "silence";
    an audio stream whose packets are garbage: `corrupt_audio`; a track shorter than the span is padded with
    silence."""
    silent = media.encode_clip(media.gray_frames(24))
    with pytest.raises(SampleError) as caught:
        decode_sound(silent, 0.0, 1.125, STEREO_16K)
    assert caught.value.reason == "missing_audio" and "data.missing_audio" in caught.value.detail
    assert torch.equal(decode_sound(silent, 0.0, 1.125, SoundRequest(16000, 2, "silence")), torch.zeros(2, 18000))
    with pytest.raises(SampleError, match="missing_audio: the clip has an audio stream without a decodable frame"):
        decode_sound(
            clip_with_sound(np.zeros((2, 0), np.float32), 16000, container_format="matroska"), 0.0, 1.0, STEREO_16K
        )  # mp4 drops a track without packets; Matroska keeps it
    short = clip_with_sound(np.full((2, 8000), 0.4, np.float32), 16000, seconds=3.0)  # 0.5 s of sound
    padded = decode_sound(short, 0.0, 1.0, STEREO_16K)
    assert padded[:, 2000:7000].abs().min() > 0.2 and padded[:, 9000:].abs().max() < 0.01
    with pytest.raises(SampleError) as caught:
        decode_sound(garbage_audio_clip(), 0.0, 1.0, STEREO_16K)
    assert caught.value.reason == "corrupt_audio"


def garbage_audio_clip() -> bytes:
    """An mkv whose audio stream says FLAC but holds random bytes."""
    out = io.BytesIO()
    rng = np.random.default_rng(0)
    with av.open(out, mode="w", format="matroska") as container:
        video = container.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("flac", rate=16000, layout="stereo")
        for index in range(16):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 90, np.uint8), format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, 8)
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        for index in range(16):
            packet = av.Packet(rng.integers(0, 256, 600, dtype=np.uint8).tobytes())
            packet.stream, packet.pts, packet.dts, packet.time_base = (
                audio,
                index * 1000,
                index * 1000,
                Fraction(1, 16000),
            )
            container.mux(packet)
    return out.getvalue()


# ----------------------------------------------------------------------------- whole runs (tiny LTX-2)
@pytest.fixture(scope="module")
def sound_raw(clips_dir, tmp_path_factory, media):
    """One raw tar of 6 real pieces (1.2 s, at most 128 px): 4 with a sound track (tones of different pitch,
    noise), 2 without; returns (folder, keys with sound, keys without)."""
    clips = sorted(clips_dir.glob("*.mp4"))
    pieces = [
        (clip.stem, index, video) for clip in clips[:3] for index, video in enumerate(cut_clip(clip, 1.2, 128)[:2])
    ]
    kinds = ["tone", "tone", "noise", "none", "tone", "none"]
    members, heard, silent = [], set(), set()
    for (stem, index, video), kind in zip(pieces, kinds):
        key = f"{stem}-{index:03d}"
        members += [(f"{key}.mp4", with_sound(video, kind, len(members))), (f"{key}.txt", f"{stem} piece".encode())]
        (silent if kind == "none" else heard).add(f"raw-000000/{key}")
    folder = tmp_path_factory.mktemp("raw-sound")
    media.write_tar(folder / "raw-000000.tar", members)
    return folder, heard, silent


def run_stage1(tiny_model_factory, raw, tmp_path, name, workers=0, audio=False, missing="skip"):
    """A stage-1 run of the tiny LTX-2 over `raw`: (config, report, {key: ({name: tensor}, bucket name)})."""
    config = load_config(
        write_config(
            tmp_path / f"{name}.toml",
            tiny_model_factory("ltx-2"),
            raw,
            tmp_path / name,
            str(tmp_path / f"{name}-window"),
            model={"family": "ltx-2", "max_text_tokens": 16, "audio": audio},
            data={"missing_audio": missing},
            buckets={"sizes": SIZES},
            window={"size": "keep"},
            precompute={"workers": workers, "samples_per_shard": 4, "storage_dtype": "float32"},
        )
    )
    report = Precompute(config).run()
    window = open_reader(str(tmp_path / f"{name}-window"))
    stored = {}
    for _, record in window.order():
        tensors, keys, meta = decode_shard(window.read_shard(record))
        stored.update({key: ({n: t[i] for n, t in tensors.items()}, meta["bucket"]) for i, key in enumerate(keys)})
    return config, report, stored


def test_shards_hold_the_audio_latents_and_silent_clips_are_skipped(sound_raw, tiny_model_factory, tmp_path):
    """model.audio, missing_audio "skip" (worker processes): the 4 clips with sound are committed, each with
    `audio_latents` of `sound.latent_shape` beside its latents under its key, equal to encoding its sound
    decoded directly; the 2 silent ones are each listed once in rejects.jsonl as `missing_audio`."""
    folder, heard, silent = sound_raw
    config, report, stored = run_stage1(tiny_model_factory, folder, tmp_path, "skip", workers=1, audio=True)
    lines = [json.loads(line) for line in (tmp_path / "skip" / "rejects.jsonl").read_text().splitlines()]
    assert sorted(line["key"] for line in lines) == sorted(silent)
    assert {line["reason"] for line in lines} == {"missing_audio"} and all(line["detail"] for line in lines)
    assert report.status == "done" and report.committed == 4 and dict(report.rejected) == {"missing_audio": 2}
    assert set(stored) == heard

    from vt.shared.models import spec_for

    spec = spec_for(config)
    for key, (tensors, bucket) in stored.items():
        shape = spec.sound.latent_shape(parse_buckets([bucket])[0])
        assert tuple(tensors["audio_latents"].shape) == shape == (2, 28, 2), key  # 9 frames at 8 fps: 1.125 s x 25
    encoders = spec.load_stage1()
    shards = list_raw_shards(str(folder))
    raws = [raw for raw in iter_raw_samples(shards[0], shard_names(shards)[shards[0]]) if raw.sample_id in heard]
    request = SoundRequest(16000, 2, "skip")
    expected = {}
    for raw in raws[:2]:
        (prepared,) = build_chain([]).prepare(raw, parse_buckets(SIZES), 8.0, sound=request)
        expected[raw.sample_id] = spec.sound.encode(encoders, prepared.sound[None])["audio_latents"][0]
        torch.testing.assert_close(
            stored[raw.sample_id][0]["audio_latents"], expected[raw.sample_id], atol=1e-4, rtol=1e-4
        )
    first, second = expected.values()
    assert not torch.allclose(first, second, atol=1e-2)  # two pitches, two encodings


def test_silence_commits_every_clip_and_video_only_reads_no_sound(sound_raw, tiny_model_factory, tmp_path):
    """missing_audio "silence": every clip is committed, a silent one with the encoding of zeros; model.audio
    false: every clip is committed with no `audio_latents` (the shards of a video-only run), and the latents
    are the same as the audio run's."""
    folder, heard, silent = sound_raw
    config, report, stored = run_stage1(tiny_model_factory, folder, tmp_path, "silence", audio=True, missing="silence")
    assert report.committed == 6 and not report.rejected and set(stored) == heard | silent

    from vt.shared.models import spec_for

    spec = spec_for(config)
    zeros = spec.sound.encode(spec.load_stage1(), torch.zeros(1, 2, 18000))["audio_latents"][0]
    for key in silent:
        torch.testing.assert_close(stored[key][0]["audio_latents"], zeros)
    _, plain_report, plain = run_stage1(tiny_model_factory, folder, tmp_path, "plain")
    assert plain_report.committed == 6 and set(plain) == set(stored)
    assert all(
        set(tensors) == {"latents", "prompt_embeds", "prompt_attention_mask"} for tensors, _ in plain.values()
    ), {name for tensors, _ in plain.values() for name in tensors}
    for key, (tensors, _) in plain.items():
        torch.testing.assert_close(tensors["latents"], stored[key][0]["latents"])


def test_audio_settings_are_part_of_the_fingerprint(tiny_model_factory, tmp_path):
    """model.audio, data.missing_audio and the family's sound format change the fingerprint (the audio VAE joins
    the weights); a video-only config records no audio setting at all, as before audio existed."""
    model = tmp_path / "ltx-2"
    shutil.copytree(tiny_model_factory("ltx-2"), model)
    base = load_config(
        write_config(
            tmp_path / "a.toml",
            model,
            tmp_path,
            tmp_path / "run",
            str(tmp_path / "w"),
            model={"family": "ltx-2", "max_text_tokens": 16},
            buckets={"sizes": SIZES},
        )
    )
    plain = provenance(base)
    assert "audio" not in plain["processing"] and "audio_vae" not in plain["weights"]
    base.model.audio = True
    heard = provenance(base)
    assert heard["processing"]["audio"] == {"sample_rate": 16000, "channels": 2, "missing": "skip"}
    assert "audio_vae" in heard["weights"]
    base.data.missing_audio = "silence"
    silence = provenance(base)
    assert len({fingerprint(p) for p in (plain, heard, silence)}) == 3
    config_file = model / "audio_vae" / "config.json"
    config_file.write_text(config_file.read_text().replace('"sample_rate": 16000', '"sample_rate": 24000'))
    other = provenance(base)
    assert other["processing"]["audio"]["sample_rate"] == 24000 and fingerprint(other) != fingerprint(silence)
