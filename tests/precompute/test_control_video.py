"""Stage 1 with a control video per sample (`<key>.control.mp4`, for families that train on one), on the real
clips and their derived control clips (edge maps, lossless re-encodes, half-size and cut versions made here
with PyAV): the sources read the member, the chain decodes it at the clip's own timestamps with the clip's
size and crop, its problems are rejects named for it, and a whole run stores what the family makes of it
while a sample without one is rejected and the rest commits."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections import Counter
from dataclasses import replace
from fractions import Fraction

import av
import pytest
import torch

from vt.precompute.processors import SampleError, build_chain
from vt.precompute.service import Precompute
from vt.precompute.sources import iter_raw_samples, list_raw_shards, shard_names
from vt.shared.buckets import Bucket
from vt.shared.config import load_config
from vt.shared.shards import decode_shard
from vt.shared.window import open_reader

from helpers.cli_runs import raw_keys, write_config

BUCKETS = [Bucket(9, 64, 96), Bucket(9, 96, 64), Bucket(9, 64, 64)]


def reencode(
    video: bytes, scale: float = 1.0, repeat: int = 1, frames: int | None = None, crop_width: int | None = None
) -> bytes:
    """The clip re-encoded from its decoded yuv420p frames with qp 0 (lossless, so the same pixels come back):
    scaled by `scale`, each frame shown `repeat` times at `repeat` x the frame rate, only its first `frames`,
    or cut to `crop_width` columns (another aspect ratio)."""
    out = io.BytesIO()
    with av.open(io.BytesIO(video)) as source, av.open(out, "w", format="mp4") as container:
        stream = source.streams.video[0]
        rate = stream.average_rate * repeat
        height = int(stream.codec_context.height * scale) // 2 * 2
        width = int(stream.codec_context.width * scale) // 2 * 2
        target = container.add_stream("libx264", rate=rate)
        target.height, target.width, target.pix_fmt = height, crop_width or width, "yuv420p"
        target.codec_context.options = {"qp": "0", "preset": "ultrafast"}
        count = 0
        for index, frame in enumerate(source.decode(stream)):
            if frames is not None and index >= frames:
                break
            rgb = frame.reformat(width=width, height=height, format="rgb24").to_ndarray()[:, : crop_width or width]
            planes = (
                av.VideoFrame.from_ndarray(rgb.copy(), format="rgb24").reformat(format="yuv420p").to_ndarray()
                if crop_width
                else frame.reformat(width=width, height=height, format="yuv420p").to_ndarray()
            )
            for _ in range(repeat):
                picture = av.VideoFrame.from_ndarray(planes, format="yuv420p")
                picture.pts, picture.time_base = count, 1 / Fraction(rate)
                count += 1
                container.mux(target.encode(picture))
        container.mux(target.encode(None))
    return out.getvalue()


@pytest.fixture(scope="module")
def samples(control_shards):
    """Every raw sample of the control shard set, each with its control video read (13 real pieces)."""
    shards = list_raw_shards(str(control_shards))
    names = shard_names(shards)
    return [raw for shard in shards for raw in iter_raw_samples(shard, names[shard], control="control")]


def test_control_frames_are_the_clips_own_timestamps_size_and_crop(samples):
    """A control video that is the clip itself gives the clip's pixels exactly, for seeded random starts and
    crops and for every window; one at twice the frame rate (each frame twice, lossless) too, so frames are
    picked by time, not by index; one at half the size comes back at the clip's size, close to the clip and
    further from it one frame later or 4 pixels over, so it is scaled to the clip's covering size and cut at
    the clip's box."""
    random = build_chain([{"name": "sample_frames", "mode": "random", "seed": 3}, {"name": "crop", "mode": "random"}])
    windows = build_chain([{"name": "sample_frames", "mode": "all_windows", "max_windows": 2}])
    assert all(raw.error is None and raw.control for raw in samples)
    for raw in samples[::3]:
        own = random.prepare(replace(raw, control=raw.video), BUCKETS, 8.0)
        split = windows.prepare(replace(raw, control=raw.video), [Bucket(5, b.height, b.width) for b in BUCKETS], 8.0)
        double = random.prepare(replace(raw, control=reencode(raw.video, repeat=2)), BUCKETS, 8.0)
        assert len(split) == 2 and all(torch.equal(s.pixels, s.control_pixels) for s in [*own, *split, *double])
        (half,) = random.prepare(replace(raw, control=reencode(raw.video, scale=0.5)), BUCKETS, 8.0)
        assert half.control_pixels.shape == half.pixels.shape == own[0].pixels.shape
        clip, control = half.pixels.float(), half.control_pixels.float()
        aligned = (clip - control).abs().mean()
        later = (clip[:, 1:] - control[:, :-1]).abs().mean()
        over = (clip[..., 4:] - control[..., :-4]).abs().mean()
        assert aligned < 6 and aligned < later and aligned < over, (raw.sample_id, aligned, later, over)
    (edges,) = random.prepare(samples[0], BUCKETS, 8.0)  # the shipped control: edge maps, gray and mostly dark
    assert edges.control_pixels.shape == edges.pixels.shape and edges.control_pixels.float().mean() < 100
    assert torch.equal(edges.control_pixels[0], edges.control_pixels[1])


def test_control_problems_are_rejects_named_for_the_control(samples):
    """A control video that ends before the sampled frames, has another aspect ratio or cannot be decoded
    rejects the sample with a `control_` reason and a detail saying so; the clip's own problems keep theirs."""
    chain = build_chain([])
    raw = samples[0]  # 1.5 s; the bucket needs 9 frames at 8 fps: 1.125 s
    cases = {
        "control_too_short": reencode(raw.video, frames=12),  # about 0.5 s
        "control_aspect": reencode(raw.video, crop_width=128),  # a 144 x 128 picture of a 256 x 144 clip
        "control_corrupt_video": raw.control[:300],
        "control_empty_video": b"",
    }
    for reason, control in cases.items():
        with pytest.raises(SampleError) as caught:
            chain.prepare(replace(raw, control=control), BUCKETS, 8.0)
        assert caught.value.reason == reason and "control video" in caught.value.detail, caught.value
    assert "s; the sampled frames run from 0s to 1.125s" in str(_reject(chain, raw, cases["control_too_short"]))
    with pytest.raises(SampleError, match="too_short"):  # the clip too short: its own reason, not the control's
        chain.prepare(replace(raw, video=reencode(raw.video, frames=12)), BUCKETS, 8.0)


def _reject(chain, raw, control) -> SampleError:
    try:
        chain.prepare(replace(raw, control=control), BUCKETS, 8.0)
    except SampleError as err:
        return err
    raise AssertionError("no reject")


def test_sources_read_the_control_member_of_tars_and_media_folders(samples, control_shards, raw_shards, tmp_path):
    """`<key>.control.mp4` beside `<key>.mp4`: in a tar, and in a media folder, where it is never a sample of its
    own; asked for and absent, the sample is `missing_control` with its key; not asked for, nothing is read."""
    with tarfile.open(control_shards / "raw-000000.tar") as tar:
        first = tar.extractfile("bigbuckbunny-000.control.mp4").read()
        video = tar.extractfile("bigbuckbunny-000.mp4").read()
    assert samples[0].sample_id == "raw-000000/bigbuckbunny-000" and samples[0].control == first
    plain = next(iter_raw_samples(str(control_shards / "raw-000000.tar")))
    assert plain.control is None and plain.error is None  # a family without control videos reads none
    missing = next(iter_raw_samples(str(raw_shards / "raw-000000.tar"), control="control"))
    assert missing.error == "missing_control" and "bigbuckbunny-000.control.mp4" in missing.detail

    folder = tmp_path / "media"
    folder.mkdir()
    for stem in ("a", "b"):
        (folder / f"{stem}.mp4").write_bytes(video)
        (folder / f"{stem}.txt").write_text("a rabbit")
    (folder / "a.control.mp4").write_bytes(first)
    units = list_raw_shards(str(folder))
    assert [u.rsplit("/", 1)[-1] for u in units] == ["a.mp4", "b.mp4"]
    read = {raw.key: raw for unit in units for raw in iter_raw_samples(unit, control="control")}
    assert read["a"].error is None and read["a"].control == first
    assert read["b"].error == "missing_control" and read["b"].control is None
    assert iter_raw_samples(units[0]).__next__().control is None


def test_a_run_stores_the_control_latents_and_rejects_samples_without_a_control(
    control_shards, tiny_model_factory, tmp_path
):
    """Of two raw tars (5 samples), two samples lose their control video (one has none, one's ends too soon):
    both are rejected with their keys and reasons in rejects.jsonl, the other 3 are committed, each with the
    family's `control_latents` of its own control video (equal to encoding its prepared control directly)."""
    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    shutil.copy(control_shards / "raw-000003.tar", raw_dir)
    with tarfile.open(control_shards / "raw-000001.tar") as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    names = [name for name, _ in members]
    dropped, cut = names[1], names[4]  # bikes-001.control.mp4, bikes-002.control.mp4
    assert dropped.endswith(".control.mp4") and cut.endswith(".control.mp4")
    with tarfile.open(raw_dir / "raw-000001.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            if name == dropped:
                continue
            data = reencode(data, frames=12) if name == cut else data
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

    model = tiny_model_factory("wan-vace")
    config = load_config(
        write_config(
            tmp_path / "pre.toml",
            model,
            raw_dir,
            tmp_path / "run",
            str(tmp_path / "window"),
            model={"family": "wan-vace", "max_text_tokens": 16},
            buckets={"sizes": ["9x32x48", "9x32x32", "9x48x32"]},
            window={"size": "keep"},
            precompute={"workers": 0, "samples_per_shard": 4, "storage_dtype": "float32"},
        )
    )
    report = Precompute(config).run()
    rejected = {
        "raw-000001/" + dropped.split(".")[0]: "missing_control",
        "raw-000001/" + cut.split(".")[0]: "control_too_short",
    }
    lines = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert {line["key"]: line["reason"] for line in lines} == rejected
    assert all(line["detail"] for line in lines)
    assert report.status == "done" and report.committed == 3 and dict(report.rejected) == Counter(rejected.values())

    window = open_reader(str(tmp_path / "window"))
    stored = {}
    for _, record in window.order():
        tensors, keys, _ = decode_shard(window.read_shard(record))
        assert tensors["control_latents"].shape[:2] == (len(keys), 32)
        stored.update({key: {name: t[i] for name, t in tensors.items()} for i, key in enumerate(keys)})
    assert set(stored) == raw_keys(raw_dir) - set(rejected)

    from vt.shared.models import spec_for

    spec = spec_for(config)
    vae = spec.load_component("vae")
    shards = list_raw_shards(str(raw_dir))
    raw = next(
        raw
        for raw in iter_raw_samples(shards[0], shard_names(shards)[shards[0]], control="control")
        if raw.sample_id in stored
    )
    (prepared,) = build_chain([]).prepare(raw, spec_buckets(config), config.buckets.fps)
    expected = spec.encode_control(vae, prepared.control[None])[0]
    torch.testing.assert_close(stored[prepared.key]["control_latents"], expected, atol=1e-5, rtol=1e-5)
    reactive = stored[prepared.key]["control_latents"][16:]  # the edge map's, not the clip's
    assert not torch.allclose(reactive, stored[prepared.key]["latents"], atol=0.1)


def spec_buckets(config) -> list[Bucket]:
    from vt.shared.buckets import parse_buckets

    return parse_buckets(config.buckets.sizes)
