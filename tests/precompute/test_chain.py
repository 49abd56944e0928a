"""The processor chain on the real clips: each built-in, a user processor by import path, the service.

Every pixel check compares with a reference made the plain way (probe, decode_at at the expected
times and size, fit_pixels at the expected crop), so a processor that picked other frames or another
crop fails. The user processor is defined here and loaded by its import path, also in a spawned
decode worker, as the service runs it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from typing import Literal

import pytest
import torch

from vt.precompute.processors import Processor, SampleError, build_chain, decode_at, fit_pixels, probe, sample_times
from vt.precompute.processors.caption import strip_boilerplate
from vt.precompute.processors.decode import Clip
from vt.precompute.processors.sample import Sample
from vt.precompute.service import Precompute
from vt.precompute.sources import RawSample, iter_raw_samples
from vt.shared.buckets import Bucket, crop_box, resize_for_crop
from vt.shared.chain import BUILTINS, ProcessorOptions, describe_chain, load_user_class, resolve_chain
from vt.shared.config import ConfigError, load_config
from vt.shared.storage import Storage
from vt.shared.window import Writer, open_reader

from helpers.cli_runs import raw_keys, write_config


class Mirror(Processor):
    """A user processor, after decode: flips the pixels. Loaded as `<this module>:Mirror`."""

    class Options(ProcessorOptions):
        VERSION = 2
        axis: Literal["width", "height"] = "width"

    def __call__(self, sample: Sample):
        yield replace(sample, pixels=sample.pixels.flip(3 if self.options.axis == "width" else 2))


MIRROR = f"{__name__}:Mirror"
SMALL = [Bucket(5, 32, 64)]  # bikes is 640x272: 80 frames at 8 fps, 16 windows of 5


def run_steps(video: bytes, key: str, entries: list[dict], buckets=SMALL, upto: int | None = None) -> list[Sample]:
    """The samples the chain's first `upto` steps make of one clip (all steps by default)."""
    chain = build_chain(entries)
    with Clip(video) as clip:
        samples = [Sample(key=key, caption="c", clip=clip, fps=8.0, buckets=buckets)]
        for processor in chain.processors[:upto]:
            samples = [out for sample in samples for out in processor(sample)]
    return samples


def reference(video: bytes, bucket: Bucket, start: float, box=None) -> torch.Tensor:
    """decode_at at the bucket's times from `start`, scaled to cover it, cropped at `box` (default centered)."""
    info = probe(video)
    size = resize_for_crop(info.height, info.width, bucket)
    return fit_pixels(decode_at(video, sample_times(info, 8.0, bucket.frames, start), info, size=size), bucket, box)


@pytest.fixture(scope="module")
def bikes(clips_dir) -> bytes:
    return (clips_dir / "bikes.mp4").read_bytes()


def test_the_default_chain_is_the_fixed_pipeline(raw_tars):
    """[] resolves to sample_frames(start) -> crop(center) -> decode, and prepares what it always did."""
    assert [s.name for s in resolve_chain([])] == ["sample_frames", "crop", "decode"]
    for name, builtin in BUILTINS.items():  # the one table: each built-in's class, with the table's options
        assert load_user_class(builtin.implementation).Options is builtin.options, name
    raw = next(iter_raw_samples(str(raw_tars[0])))
    (prepared,) = build_chain([]).prepare(raw, [Bucket(9, 64, 96), Bucket(9, 64, 64)], 8.0)
    assert prepared.key == raw.sample_id and prepared.caption == raw.caption
    assert torch.equal(prepared.pixels, reference(raw.video, Bucket(9, 64, 96), 0.0))


def test_sample_frames_start_random_windows_and_uniform(bikes):
    (start,) = run_steps(bikes, "bikes", [], upto=1)
    assert (start.key, start.bucket, start.start) == ("bikes", SMALL[0], 0.0)

    random = [run_steps(bikes, key, [{"name": "sample_frames", "mode": "random"}], upto=1)[0] for key in "abcd"]
    assert all(s.start * 8 == round(s.start * 8) and 0 <= s.start <= (80 - 5) / 8 for s in random)
    assert len({s.start for s in random}) > 1  # drawn per key ...
    again = run_steps(bikes, "c", [{"name": "sample_frames", "mode": "random"}])[0]
    assert again.start == random[2].start  # ... and the same draw every time
    assert torch.equal(again.pixels, reference(bikes, SMALL[0], again.start))
    reseeded = [
        run_steps(bikes, key, [{"name": "sample_frames", "mode": "random", "seed": 7}], upto=1)[0] for key in "abcd"
    ]
    assert [s.start for s in reseeded] != [s.start for s in random]

    every = run_steps(bikes, "bikes", [{"name": "sample_frames", "mode": "all_windows"}], upto=1)
    assert [s.key for s in every] == [f"bikes#w{i}" for i in range(16)]
    assert [s.start for s in every] == [i * 5 / 8 for i in range(16)]  # back to back, never overlapping
    windows = run_steps(bikes, "bikes", [{"name": "sample_frames", "mode": "all_windows", "max_windows": 2}])
    assert [s.key for s in windows] == ["bikes#w0", "bikes#w1"]
    assert torch.equal(windows[1].pixels, reference(bikes, SMALL[0], 5 / 8))
    assert not torch.equal(windows[0].pixels[:, -1], windows[1].pixels[:, 0])  # the next window moves on

    # uniform: starts spread evenly from 0 to the last start (80 - 5 frame steps), spacing still 1/fps.
    spread = run_steps(bikes, "bikes", [{"name": "sample_frames", "mode": "uniform", "windows": 4}], upto=1)
    assert [(s.key, s.start) for s in spread] == [(f"bikes#w{i}", i * 25 / 8) for i in range(4)]
    (last,) = run_steps(bikes, "bikes", [{"name": "sample_frames", "mode": "uniform", "windows": 4}])[3:]
    assert torch.equal(last.pixels, reference(bikes, SMALL[0], 75 / 8))
    crowded = run_steps(bikes, "bikes", [{"name": "sample_frames", "mode": "uniform", "windows": 500}], upto=1)
    assert len(crowded) == 76 and len({s.start for s in crowded}) == 76  # never two samples of one start

    with pytest.raises(SampleError) as err:
        run_steps(bikes, "bikes", [], buckets=[Bucket(81, 32, 64)], upto=1)
    assert err.value.reason == "too_short"


def test_crop_center_and_random(bikes):
    bucket = Bucket(5, 32, 32)  # bikes covers it at 32x75: the crop can sit anywhere along the width
    (center,) = run_steps(bikes, "bikes", [], buckets=[bucket])
    assert center.box == crop_box(32, 75, bucket) and torch.equal(center.pixels, reference(bikes, bucket, 0.0))
    boxes = [
        run_steps(bikes, key, [{"name": "crop", "mode": "random"}], buckets=[bucket], upto=2)[0].box for key in "abcd"
    ]
    assert all(top == 0 and 0 <= left <= 75 - 32 for top, left in boxes) and len(set(boxes)) > 1
    (cut,) = run_steps(bikes, "b", [{"name": "crop", "mode": "random"}], buckets=[bucket])
    assert cut.box == boxes[1] and torch.equal(cut.pixels, reference(bikes, bucket, 0.0, boxes[1]))


def test_caption_field_boilerplate_and_prefix(raw_tars, media, tmp_path):
    video = next(iter_raw_samples(str(raw_tars[0]))).video
    meta = {"caption": "The video shows a red car.", "long": "a red car on a wet road"}
    tar = media.write_tar(
        tmp_path / "cap.tar",
        [
            ("a.mp4", video),
            ("a.json", json.dumps(meta).encode()),
            ("b.mp4", video),
            ("b.json", json.dumps({"long": "only the long one"}).encode()),
        ],
    )
    a, b = iter_raw_samples(str(tar))
    assert a.meta == meta and b.error == "missing_caption" and b.meta == {"long": "only the long one"}
    buckets = [Bucket(9, 64, 96)]

    def captions(raw: RawSample, entries: list[dict]) -> list[str]:
        return [p.caption for p in build_chain(entries).prepare(raw, buckets, 8.0)]

    assert captions(a, [{"name": "caption", "strip_boilerplate": True, "prefix": "sks style, "}]) == [
        "sks style, A red car."
    ]
    assert captions(a, [{"name": "caption", "field": "long", "suffix": "."}]) == ["a red car on a wet road."]
    assert captions(b, [{"name": "caption", "field": "long"}]) == ["only the long one"]  # source's reject lifted
    with pytest.raises(SampleError) as err:
        captions(b, [])  # no caption step reads "long": still missing_caption, as the source said
    assert err.value.reason == "missing_caption"
    with pytest.raises(SampleError) as err:
        captions(a, [{"name": "caption", "field": "short"}])
    assert err.value.reason == "missing_caption" and "'short'" in err.value.detail
    assert strip_boilerplate("In this video, a dog runs") == "A dog runs"
    assert strip_boilerplate("A dog runs") == "A dog runs"


def test_options_are_checked_at_load_naming_the_processor_and_key():
    def problem(entries) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"precompute.processors={entries}"])
        return str(err.value)

    assert "processor 0 ('caption') option 'prefx' is unknown; allowed: field, prefix" in problem(
        '[{name="caption", prefx="a"}]'
    )
    assert "processor 1 ('sample_frames') option 'mode' = 'middle'" in problem(
        '[{name="caption"}, {name="sample_frames", mode="middle"}]'
    )
    assert f"processor 0 ('{MIRROR}') option 'axis' = 'diagonal'" in problem(f'[{{name="{MIRROR}", axis="diagonal"}}]')
    assert "out of order" in problem('[{name="decode"}, {name="crop"}]')
    assert "neither a built-in" in problem('[{name="mirror"}]')
    assert "cannot import 'no_such_pkg.mod'" in problem('[{name="no_such_pkg.mod:Thing"}]')
    config = load_config(None, ['precompute.processors=[{name="sample_frames", mode="random", seed=3}]'])
    assert describe_chain(config.precompute.processors)[0] == {
        "name": "sample_frames",
        "version": 1,
        "mode": "random",
        "seed": 3,
        "max_windows": 0,
        "windows": 2,
    }


def test_user_processor_by_import_path(bikes):
    entries = [{"name": "decode"}, {"name": MIRROR, "axis": "width"}]
    assert describe_chain(entries)[-1] == {"name": MIRROR, "version": 2, "axis": "width"}  # into provenance
    plain, mirrored = run_steps(bikes, "bikes", [])[0], run_steps(bikes, "bikes", entries)[0]
    assert torch.equal(mirrored.pixels, plain.pixels.flip(3)) and not torch.equal(mirrored.pixels, plain.pixels)


class CrashAfterFirstCommit(Writer):
    """A real window writer whose first publish raises right after the record is created (a producer dying there)."""

    def publish(self, record, data):
        out = super().publish(record, data)
        if record.seq == 0:
            raise RuntimeError("died after the first commit")
        return out


def test_service_commits_every_window_once_through_a_user_processor(tmp_path, tiny_model_factory, raw_tars):
    """all_windows + a user processor, run by the service in a spawned decode worker: at 16 fps a
    1.5 s sample holds two 9-frame windows, each committed once under its own key, also when the
    producer dies with one window of a clip committed and the other still buffered (3 per shard)."""
    raw, uri = raw_tars[0], str(tmp_path / "w")
    chain = [{"name": "sample_frames", "mode": "all_windows"}, {"name": "decode"}, {"name": MIRROR}]
    path = write_config(
        tmp_path / "c.toml",
        tiny_model_factory("ltx-video"),
        raw,
        tmp_path / "run",
        uri,
        window={"size": "keep"},
        buckets={"fps": 16.0},
        precompute={"workers": 1, "samples_per_shard": 3, "processors": chain},
    )
    first = Precompute(load_config(path))
    first.window = CrashAfterFirstCommit(Storage(uri), "keep", 0.01, 30.0)
    with pytest.raises(RuntimeError, match="died after the first commit"):
        first.run()
    report = Precompute(load_config(path, ["precompute.workers=0"])).run()  # the restart decodes in-process
    keys = Counter(key for _, record in open_reader(uri).order() for key in record.keys)
    assert set(keys) == {f"{key}#w{i}" for key in raw_keys(raw) for i in (0, 1)} and set(keys.values()) == {1}
    assert report.resumed_at == 1 and report.skipped_committed == 3  # the first shard's windows, dropped
    assert report.committed == len(keys) - 3 and report.rejected == {}
