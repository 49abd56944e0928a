"""split_scenes, the filters and dedup on real clips: a video joined from three demo clips cut back at its joins,
a still, a black video and a copy rejected with their reasons (and nothing else), then a short training run.

Every video here is made from the demo clips' real frames with PyAV (96x64, 16 fps, h264), so detection
and decoding run on real footage at a size that keeps the test short.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import av
import numpy as np
import pytest

from vt.precompute.processors import Sample
from vt.precompute.processors.crop import Crop
from vt.precompute.processors.decode import Clip
from vt.precompute.processors.dedup import bands, clip_hash, decision_path, distance, keeper
from vt.precompute.processors.fit_bucket import Decode
from vt.precompute.processors.sample_frames import SampleFrames
from vt.precompute.processors.split_scenes import SplitScenes, pieces
from vt.precompute.service import Precompute
from vt.shared.buckets import Bucket
from vt.shared.chain import BUILTINS, resolve_chain
from vt.shared.config import load_config
from vt.shared.storage import Storage
from vt.train.trackers import read_metrics
from vt.train.trainer import Trainer

from helpers.cli_runs import write_config

FPS, SIZE = 16, (64, 96)  # the made videos' rate and (height, width)
JOINED = (("bigbuckbunny", 22), ("bikes", 26), ("carphone_pristine", 30))  # clip, frames taken from its start
BUCKETS = [Bucket(9, 64, 96)]
CARPHONES = ("carphone_pristine", "carphone_distorted")
# The chain of the acceptance run: every new processor listed (filters with thresholds the real clips pass).
CURATION = [
    {"name": "split_scenes", "min_seconds": 1.0, "max_seconds": 4.0},
    {"name": "filter_size", "min_seconds": 1.0, "min_height": 32, "min_width": 32},
    {"name": "decode"},
    {"name": "filter_black"},
    {"name": "filter_frozen"},
    {"name": "filter_motion", "min_motion": 0.2, "max_motion": 80.0},
    {"name": "dedup"},
]


def frames_of(clip: Path, count: int, skip: int = 0) -> list[np.ndarray]:
    """`count` consecutive frames of a real clip after `skip`, as (64, 96, 3) RGB."""
    out = []
    with av.open(str(clip)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if index >= skip:
                out.append(frame.to_ndarray(format="rgb24", width=SIZE[1], height=SIZE[0]))
            if len(out) == count:
                return out
    raise AssertionError(f"{clip.name} has fewer than {skip + count} frames")


def encode(path: Path, frames: list[np.ndarray]) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"g": "16", "crf": "18"})
        stream.height, stream.width, stream.pix_fmt = *SIZE, "yuv420p"
        for index, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def curated_folder(clips_dir, tmp_path_factory) -> Path:
    """joined.mp4 (three demo clips end to end), still, black, a piece of bigbuckbunny and of bikes from further
    in (not the joined video's frames), a byte copy of the bikes piece under another name, and a bikes shot (after
    its scene change) followed by black (to-black.mp4: two scenes); .txt captions.
    (No carphone piece: the talking head looks the same all through, so any piece of it, pristine or distorted,
    is a near-duplicate of the joined video's third scene.)"""
    out = tmp_path_factory.mktemp("curated")
    encode(out / "joined.mp4", [f for name, count in JOINED for f in frames_of(clips_dir / f"{name}.mp4", count)])
    for name in ("bigbuckbunny", "bikes"):
        encode(out / f"{name}.mp4", frames_of(clips_dir / f"{name}.mp4", 20, skip=40))
    (out / "bikes-again.mp4").write_bytes((out / "bikes.mp4").read_bytes())
    still = frames_of(clips_dir / "bikes.mp4", 1)[0]
    encode(out / "still.mp4", [still] * 24)
    encode(out / "black.mp4", [np.zeros_like(still)] * 24)
    # A shot that fades to black: its black scene is rejected alone, the shot kept.
    encode(out / "to-black.mp4", frames_of(clips_dir / "bikes.mp4", 20, skip=150) + [np.zeros_like(still)] * 20)
    for video in out.glob("*.mp4"):
        video.with_suffix(".txt").write_text(f"a clip called {video.stem}")
    return out


def joins() -> list[float]:
    counts = [count for _, count in JOINED]
    return [sum(counts[: i + 1]) / FPS for i in range(len(counts) - 1)]


def test_a_joined_video_splits_at_its_joins_and_is_decoded_once_then_by_seeking(curated_folder):
    data = (curated_folder / "joined.mp4").read_bytes()
    with Clip(data) as clip:
        sample = Sample(key="raw/joined", caption="c", clip=clip, fps=8.0, buckets=BUCKETS)
        scenes = list(SplitScenes(SplitScenes.Options(min_seconds=1.0))(sample))
        assert [s.key for s in scenes] == ["raw/joined#s0", "raw/joined#s1", "raw/joined#s2"]
        starts = [s.clip.start for s in scenes[1:]]
        assert all(abs(start - join) <= 1 / FPS + 1e-6 for start, join in zip(starts, joins())), (starts, joins())
        assert scenes[-1].clip.end == pytest.approx(clip.info.duration)
        scanned = clip.stats["frames"]
        assert scanned >= sum(count for _, count in JOINED)  # detection saw every frame, once
        windows = [w for s in scenes for w in SampleFrames(SampleFrames.Options(mode="all_windows"))(s)]
        assert [w.key for w in windows] == [f"raw/joined#s{i}#w0" for i in range(3)]  # with the window modes
        decoded = [d for w in windows for c in Crop(Crop.Options())(w) for d in Decode(Decode.Options())(c)]
        assert [tuple(d.pixels.shape) for d in decoded] == [(3, 9, 64, 96)] * 3
        # Each scene's frames were decoded by seeking to it, never by a second pass over the whole video.
        assert clip.stats["seeks"] >= 2 and clip.stats["frames"] - scanned < scanned


def test_long_scenes_are_cut_into_equal_pieces_and_short_ones_dropped():
    # 0-0.5 s is too short; 0.5-3.5 s fits; 3.5-10.5 s (7 s) becomes three pieces of 7/3 s.
    cut = pieces([0.0, 0.5, 3.5, 10.5], 1.0, 3.0)
    assert cut == pytest.approx([(0.5, 3.5), (3.5, 3.5 + 7 / 3), (3.5 + 7 / 3, 3.5 + 14 / 3), (3.5 + 14 / 3, 10.5)])
    assert pieces([0.0, 2.0], 1.0, 0.0) == [(0.0, 2.0)]
    with pytest.raises(ValueError, match="max_seconds"):
        resolve_chain([{"name": "split_scenes", "min_seconds": 2.0, "max_seconds": 3.0}])
    with pytest.raises(ValueError, match="must run before 'sample_frames'"):
        resolve_chain([{"name": "sample_frames"}, {"name": "split_scenes"}])
    with pytest.raises(ValueError, match="must run after 'decode'"):
        resolve_chain([{"name": "filter_black"}])
    assert {"split_scenes", "filter_size", "filter_motion", "filter_black", "filter_frozen", "dedup"} <= set(BUILTINS)


def _hash(path: Path) -> str:
    with Clip(path.read_bytes()) as clip:
        return clip_hash(Sample(key="k", caption="c", clip=clip, fps=8.0, buckets=BUCKETS), 4)


def test_near_duplicates_keep_one_whatever_the_interleaving_and_after_a_restart(clips_dir, curated_folder, tmp_path):
    # The demo's carphone_distorted is carphone_pristine re-compressed: the same frames, other bytes.
    a, x = [_hash(encode(tmp_path / f"{n}.mp4", frames_of(clips_dir / f"{n}.mp4", 20, skip=40))) for n in CARPHONES]
    other = _hash(curated_folder / "bikes.mp4")
    assert a != x and distance(a, x) <= 24 < distance(a, other)  # re-compressed: a few bits; another clip: many
    assert _hash(curated_folder / "bikes-again.mp4") == other
    store = Storage(str(tmp_path / "w1"))
    assert keeper(store, a, "p0/pristine", 24) == "p0/pristine"
    assert keeper(store, x, "p1/distorted", 24) == "p0/pristine"  # another producer's copy
    assert keeper(store, other, "p1/bikes", 24) == "p1/bikes"
    resumed = Storage(str(tmp_path / "w1"))  # restarted producers make the same choices
    assert [keeper(resumed, a, "p0/pristine", 24), keeper(resumed, x, "p1/distorted", 24)] == ["p0/pristine"] * 2
    recorded = json.loads(store.read(decision_path("p1/distorted", x, 24)))  # what they read instead of the bands
    assert recorded == {"key": "p1/distorted", "hash": x, "keeper": "p0/pristine"}
    for rel in store.list("dedup/decided"):  # without the records, the bands give the same choices
        store.delete(rel)
    again = Storage(str(tmp_path / "w1"))
    assert [keeper(again, a, "p0/pristine", 24), keeper(again, x, "p1/distorted", 24)] == ["p0/pristine"] * 2
    # Two producers at once: the distorted copy has claimed half its bands when the pristine one looks.
    store = Storage(str(tmp_path / "w2"))
    for index, bits in enumerate(bands(x)[:8]):
        store.create_exclusive(
            f"dedup/{index:02d}-{bits}.json", json.dumps({"key": "p1/distorted", "hash": x}).encode()
        )
    first, second = keeper(store, a, "p0/pristine", 24), keeper(store, x, "p1/distorted", 24)
    assert first == second and first in ("p0/pristine", "p1/distorted")  # exactly one kept, both agree which


def test_a_curated_run_rejects_still_black_and_copy_with_reasons_and_trains(
    curated_folder, tiny_model_factory, tmp_path
):
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            tiny_model_factory("ltx-video"),
            curated_folder,
            tmp_path / "run",
            str(tmp_path / "window"),
            buckets={"sizes": ["9x64x96"]},
            window={"size": "keep"},
            precompute={"workers": 0, "processors": CURATION},
            train={"batch_size": 2, "max_steps": 2},
        )
    )
    report = Precompute(config).run()
    rejects = [json.loads(line) for line in (config.run_dir / "rejects.jsonl").read_text().splitlines()]
    reasons = {entry["key"].split("/")[-1]: entry["reason"] for entry in rejects}
    copies = {"bikes", "bikes-again"}
    assert {k: v for k, v in reasons.items() if k not in copies} == {
        "still": "frozen_frames",
        "black": "black_frames",
        "to-black#s1": "black_frames",  # one scene of two dropped alone, under its own key
    }
    assert [reasons[k] for k in sorted(copies) if k in reasons] == ["near_duplicate"]  # exactly one copy kept
    kept = len(list(curated_folder.glob("*.mp4"))) - 3 + 2  # joined makes 3 samples, to-black 1 (of 2 scenes)
    assert report.committed == kept, reasons
    summary = Trainer(config).run()
    assert summary["steps"] == 2
    assert all(math.isfinite(m["loss"]) for m in read_metrics(config.run_dir / "metrics.jsonl"))
