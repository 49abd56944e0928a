"""The chain's error policy: bad data is a reject, a processor's bug stops the run at once.

A user processor with a bug (a TypeError on every sample, a KeyError on one) is loaded by its
import path, as a user's is, and run by the real service: `vt-precompute run` as its own process,
and Precompute with a spawned decode worker. The run must stop on the first such sample, exit
non-zero naming the processor with its traceback, list nothing in rejects.jsonl for it and leave
only whole committed shards in the window. Corrupt clips next to a user processor stay rejects
with their key and reason, and the run goes on.
"""

from __future__ import annotations

import json
import textwrap

import av
import pytest

from vt.precompute.processors import Processor, ProcessorBug, SampleError, bad_data_only, build_chain
from vt.precompute.processors.sample import Sample
from vt.precompute.service import Precompute
from vt.precompute.sources import RawSample, iter_raw_samples
from vt.shared.buckets import Bucket
from vt.shared.chain import ProcessorOptions
from vt.shared.config import load_config
from vt.shared.shards import decode_shard
from vt.shared.window import open_reader

from helpers.cli_runs import start, write_config

BUCKETS = [Bucket(9, 64, 96)]
# A user's module, written next to the run and put on PYTHONPATH: its processor has a bug.
BROKEN_MODULE = textwrap.dedent("""
    from vt.precompute.processors import Processor


    class Broken(Processor):
        def __call__(self, sample):
            yield sample.caption + 1  # the bug: str + int
""")


class FailsOn(Processor):
    """A user processor whose bug shows on one sample only: a KeyError on `key`'s metadata."""

    class Options(ProcessorOptions):
        key: str

    def __call__(self, sample: Sample):
        if sample.key == self.options.key:
            sample.meta["no_such_field"]
        yield sample


class Reopens(Processor):
    """A user processor that opens the video again with PyAV itself (and so meets its errors)."""

    def __call__(self, sample: Sample):
        av.open(sample.meta["path"]).close()
        yield sample


def window_files(uri: str) -> tuple[list[str], list[str]]:
    storage = open_reader(uri).storage
    return sorted(storage.list("data")), sorted(storage.list("commits"))


def committed_keys(uri: str) -> list[list[str]]:
    """The keys of each shard producer 0 committed, read through its record (size and sha256 checked)."""
    window = open_reader(uri)
    return [decode_shard(window.read_shard(window.record(0, seq)))[1] for seq in range(window.next_seq(0))]


def test_a_buggy_user_processor_stops_vt_precompute_at_once(tmp_path, tiny_model_factory, raw_tars, monkeypatch):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "buggy.py").write_text(BROKEN_MODULE)
    monkeypatch.syspath_prepend(tmp_path / "user")  # write_config validates the chain here, importing it
    uri = str(tmp_path / "window")
    config = write_config(
        tmp_path / "c.toml",
        tiny_model_factory("ltx-video"),
        raw_tars[0],
        tmp_path / "run",
        uri,
        window={"size": "keep", "timeout_seconds": 120},
        precompute={"workers": 1, "processors": [{"name": "buggy:Broken"}]},
    )
    log = tmp_path / "precompute.log"
    code = start("precompute", config, log=log, env={"PYTHONPATH": str(tmp_path / "user")}).wait(timeout=300)
    out = log.read_text()

    assert code == 1, out
    message = next(line for line in out.splitlines() if line.startswith("error: "))
    assert message.startswith("error: processor 'buggy:Broken' raised TypeError: can only concatenate str")
    assert message.endswith("(a bug in the processor, not bad data; traceback above)")
    # The processor's own traceback, formatted in the decode worker, comes before the message.
    trace = out.index("Traceback (most recent call last)")
    assert trace < out.index(message) and out.index('buggy.py", line 7, in __call__') > trace
    assert "yield sample.caption + 1" in out
    assert "samples in a row failed" not in out  # stopped at the first sample, not counted as failures
    report = json.loads((tmp_path / "run" / "precompute_report.json").read_text())
    assert report["status"].startswith("failed: ProcessorBug: processor 'buggy:Broken' raised TypeError")
    assert report["seen"] == 0 and report["rejected"] == {} and report["committed"] == 0
    assert (tmp_path / "run" / "rejects.jsonl").read_text() == ""
    assert window_files(uri) == ([], [])


def test_a_bug_on_one_sample_stops_the_run_with_whole_shards_only(tmp_path, tiny_model_factory, raw_tars):
    """4 samples, 2 per shard, a KeyError on the 4th: shard 0 is committed, the 3rd sample (buffered)
    is never written as a half shard, and the error names the processor and the sample."""
    keys = [raw.sample_id for raw in iter_raw_samples(str(raw_tars[0]))]
    assert len(keys) == 4
    uri, name = str(tmp_path / "window"), f"{__name__}:FailsOn"
    config = load_config(
        write_config(
            tmp_path / "c.toml",
            tiny_model_factory("ltx-video"),
            raw_tars[0],
            tmp_path / "run",
            uri,
            window={"size": "keep", "timeout_seconds": 120},
            buckets={"sizes": ["9x64x96"]},
            precompute={"workers": 1, "samples_per_shard": 2, "processors": [{"name": name, "key": keys[3]}]},
        )
    )

    with pytest.raises(ProcessorBug) as bug:
        Precompute(config).run()

    assert str(bug.value) == (
        f"processor {name!r} raised KeyError: 'no_such_field' on sample {keys[3]!r} "
        "(a bug in the processor, not bad data; traceback above)"
    )
    assert 'sample.meta["no_such_field"]' in bug.value.traceback and "in __call__" in bug.value.traceback
    data, commits = window_files(uri)
    assert len(data) == 1 and len(commits) == 1  # shard 0 and its record, nothing else
    assert committed_keys(uri) == [keys[:2]]
    report = json.loads((tmp_path / "run" / "precompute_report.json").read_text())
    assert (report["seen"], report["committed"], report["rejected"]) == (3, 2, {})
    assert (tmp_path / "run" / "rejects.jsonl").read_text() == ""


def test_corrupt_clips_next_to_a_user_processor_are_rejects_and_the_run_goes_on(
    tmp_path, tiny_model_factory, media, good_clip
):
    raw = media.write_tar(
        tmp_path / "raw.tar",
        [
            ("a.mp4", good_clip),
            ("a.txt", b"a gray fade"),
            ("junk.mp4", b"\x00junk-not-a-container\xff" * 200),
            ("junk.txt", b"a caption"),
            ("cut.mp4", good_clip[: len(good_clip) // 2]),
            ("cut.txt", b"a caption"),
            ("b.mp4", good_clip),
            ("b.txt", b"a gray fade"),
        ],
    )
    uri = str(tmp_path / "window")
    chain = [{"name": "decode"}, {"name": f"{__name__}:FailsOn", "key": "none of them"}]
    config = load_config(
        write_config(
            tmp_path / "c.toml",
            tiny_model_factory("ltx-video"),
            raw,
            tmp_path / "run",
            uri,
            window={"size": "keep", "timeout_seconds": 120},
            buckets={"sizes": ["9x64x96"]},
            precompute={"workers": 1, "samples_per_shard": 2, "processors": chain},
        )
    )

    report = Precompute(config).run()

    assert report.status == "done" and report.committed == 2 and report.rejected == {"corrupt_video": 2}
    lines = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert [(line["key"], line["reason"]) for line in lines] == [
        ("raw/junk", "corrupt_video"),
        ("raw/cut", "corrupt_video"),
    ]
    assert all(line["detail"] for line in lines)
    assert committed_keys(uri) == [["raw/a", "raw/b"]]


def test_pyav_errors_anywhere_in_the_chain_are_bad_data(tmp_path, good_clip):
    """A processor's PyAV error is the media's fault (corrupt_video, naming the step); a policy passed
    in judges every step's exception, with the step's name."""
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00junk-not-a-container\xff" * 200)
    raw = RawSample("k", "x.tar", good_clip, "c", meta={"path": str(junk)}, name="x")
    chain = build_chain([{"name": f"{__name__}:Reopens"}])
    with pytest.raises(SampleError) as err:
        chain.prepare(raw, BUCKETS, 8.0, bad_data_only)
    assert err.value.reason == "corrupt_video" and f"'{__name__}:Reopens'" in err.value.detail

    def as_reject(exc: Exception, step: str, key: str) -> SampleError:
        return SampleError("skipped", f"{step} on {key}: {type(exc).__name__}")

    failing = build_chain([{"name": f"{__name__}:FailsOn", "key": "x/k"}])
    with pytest.raises(SampleError) as err:
        failing.prepare(raw, BUCKETS, 8.0, as_reject)
    assert (err.value.reason, err.value.detail) == ("skipped", f"{__name__}:FailsOn on x/k: KeyError")
    with pytest.raises(ProcessorBug) as bug:
        failing.prepare(raw, BUCKETS, 8.0)  # the default policy: bad_data_only
    assert bug.value.step == f"{__name__}:FailsOn" and bug.value.key == "x/k"
