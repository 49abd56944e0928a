"""Precompute throughput: the service against a naive sequential loop and against encoding alone.

Three sides over the same clips (the demo raw shards, repeated to make a longer corpus):
- service: `Precompute(config).run()`: decode workers ahead of the encoder, samples batched per
  bucket through the VAE, captions encoded once per run (text cache), one shard per bucket batch;
- naive: one sample at a time: decode it (the same `prepare_sample`), encode its caption and its
  video (batch of one), save its tensors as one safetensors file;
- encode-only: the service itself with decoding made free: every clip is decoded before the clock
  starts and a stand-in for the service's processor chain hands back the stored result. Its rate is the bound the service
  approaches when the decode workers fully hide decoding.

Start-up costs differ between the sides (the service starts worker processes while it loads the
encoders) and would swamp a short corpus, so the rates are steady-state: from the moment the first
output became visible to the last one, read from the outputs' file times (the window's commit
records, the naive loop's files), not counting the first output's samples. End-of-run remainder
shards, flushed with nothing left to decode, are left out. Every side runs in a fresh process per
round (`--threads` torch threads, as the rest of the bench), rounds rotate which side goes first,
and rows quote medians.

    python scripts/bench_precompute_throughput.py [--model runs/models/ltx-video-tiny] [--raw runs/data/raw]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_common import (
    ROOT,
    Row,
    asset_arguments,
    format_table,
    median,
    popen,
    run_timed,
    toml_string,
    write_run_config,  # noqa: E402
)

SIDES = ("service", "naive", "encode_only")
GOAL_VS_NAIVE = 1.3  # the service's samples/s at least 1.3x the naive loop's
GOAL_VS_ENCODE = 0.8  # ... and at least 0.8x the encode-only rate


def make_corpus(raw: Path, out: Path, repeats: int) -> Path:
    """The raw tars `repeats` times over, each copy's keys prefixed (r00-...): same clips, longer run."""
    import tarfile

    tars = sorted(Path(raw).glob("*.tar"))
    if not tars:
        raise FileNotFoundError(f"no .tar shards in {raw}: build them with `make assets`")
    out.mkdir(parents=True, exist_ok=True)
    for copy in range(repeats):
        for tar in tars:
            target = out / f"r{copy:02d}-{tar.name}"
            with tarfile.open(tar) as source, tarfile.open(target, "w", format=tarfile.USTAR_FORMAT) as dest:
                for member in source:
                    data = source.extractfile(member) if member.isfile() else None
                    member.name = f"r{copy:02d}-{member.name}"
                    dest.addfile(member, data)
    return out


def throughput_overrides(model: Path, raw: Path, run_dir: Path, window: Path, workers: int, batch: int) -> list[str]:
    """One pass into a kept window; shards and VAE batches of `batch` samples per bucket."""
    return [
        f"model.path={toml_string(model)}",
        f"data.raw={toml_string(raw)}",
        f"run.dir={toml_string(run_dir)}",
        f"window.uri={toml_string(window)}",
        'window.size="keep"',
        "log.progress=false",
        f"precompute.workers={workers}",
        f"precompute.samples_per_shard={batch}",
        f"precompute.encode_batch={batch}",
    ]


# ----------------------------------------------------------------------------------------- child sides
def _run_service(config) -> int:
    from vt.precompute.service import Precompute

    return Precompute(config).run().committed


def _run_naive(config) -> int:
    """Decode, encode and save one sample at a time: what a first script does."""
    import torch
    from safetensors.torch import save_file

    from vt.precompute.processors import SampleError, prepare_sample
    from vt.precompute.sources import iter_raw_samples, list_raw_shards
    from vt.shared.buckets import parse_buckets
    from vt.shared.models import spec_for
    from vt.shared.runtime import DTYPES

    spec = spec_for(config)
    buckets = parse_buckets(config.buckets.sizes)
    dtype = DTYPES[config.precompute.storage_dtype]
    device = config.precompute.device
    if device == "auto":  # the service's choice, so both sides run on the same device
        device = "cuda" if torch.cuda.is_available() else "cpu"
    encoders = spec.load_stage1(device=device)
    out = config.run_dir / "naive"
    out.mkdir(parents=True, exist_ok=True)
    done = 0
    with torch.inference_mode():
        for shard in list_raw_shards(config.data.raw):
            for raw in iter_raw_samples(shard):
                try:
                    sample = prepare_sample(raw, buckets, config.buckets.fps)
                except SampleError:
                    continue
                tensors = {
                    **spec.encode_text(encoders, [sample.caption]),
                    **spec.encode_video(encoders, sample.video[None].to(device)),
                }
                save_file(
                    {k: v[0].to("cpu", dtype).contiguous() for k, v in tensors.items()},
                    str(out / f"{done:06d}.safetensors"),
                )
                done += 1
    return done


def _clip_id(raw) -> tuple[str, int]:
    """The same clip in every copy of the corpus: its key without the copy prefix, and its size."""
    return raw.key.split("-", 1)[-1], len(raw.video or b"")


class _Decoded:
    """Stands in for the service's processor chain in the encode-only side: returns clips decoded beforehand."""

    def __init__(self, config):
        from vt.precompute.processors import SampleError, prepare_sample
        from vt.precompute.sources import iter_raw_samples, list_raw_shards
        from vt.shared.buckets import parse_buckets

        buckets = parse_buckets(config.buckets.sizes)
        self.prepared: dict[tuple[str, int], object] = {}
        for shard in list_raw_shards(config.data.raw):
            for raw in iter_raw_samples(shard):
                ident = _clip_id(raw)
                if ident not in self.prepared:
                    try:
                        self.prepared[ident] = prepare_sample(raw, buckets, config.buckets.fps)
                    except SampleError as err:
                        self.prepared[ident] = err

    def prepare(self, raw, buckets, fps, policy, sound=None, dropped=None):
        """`Chain.prepare`'s signature: the samples of one raw sample (decoded beforehand: nothing for the
        error policy to judge here, no part of it dropped; no sound: the bench trains video)."""
        found = self.prepared[_clip_id(raw)]
        if isinstance(found, Exception):
            raise found
        return [dataclasses.replace(found, key=raw.sample_id, caption=raw.caption)]


def _run_encode_only(config, decoded: _Decoded) -> int:
    from vt.precompute import service

    producer = service.Precompute(config)
    if not hasattr(producer, "chain"):
        raise RuntimeError(
            "vt.precompute.service no longer runs its processors as Precompute.chain; "
            "update _run_encode_only in scripts/bench_precompute_throughput.py"
        )
    producer.chain = decoded  # in-process (workers = 0), so the stand-in is what runs
    return producer.run().committed


def child(side: str, config_path: Path) -> dict:
    """Run one side once in this process; its wall seconds (after imports) and samples."""
    import torch

    from vt.shared.config import load_config

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    config = load_config(config_path)
    decoded = _Decoded(config) if side == "encode_only" else None  # before the clock: not timed
    started = time.perf_counter()
    if side == "service":
        count = _run_service(config)
    elif side == "naive":
        count = _run_naive(config)
    else:
        count = _run_encode_only(config, decoded)
    return {"side": side, "seconds": time.perf_counter() - started, "samples": count}


# ----------------------------------------------------------------------------------------- parent
def steady_rate(times_ns: list[int], counts: list[int]) -> tuple[float, int]:
    """(seconds per sample, samples) between the first output and the last one counted.

    `times_ns` are when outputs became visible (file mtimes), `counts` their samples. The first
    output's samples are not counted (they carry the start-up), only the time after it.
    """
    if len(times_ns) < 3:
        raise RuntimeError(f"only {len(times_ns)} outputs: too few for a steady-state rate; raise --repeats")
    order = sorted(range(len(times_ns)), key=times_ns.__getitem__)
    samples = sum(counts[i] for i in order[1:])
    seconds = (times_ns[order[-1]] - times_ns[order[0]]) / 1e9
    if seconds <= 0:
        raise RuntimeError("outputs share one timestamp: the file system's clock is too coarse for this bench")
    return seconds / samples, samples


def window_outputs(window: Path, batch: int) -> tuple[list[int], list[int]]:
    """Commit times and sizes of the full shards (the end-of-run remainders are left out: they are
    flushed at once, with no decoding left to wait for)."""
    times, counts = [], []
    for record in sorted((window / "commits").rglob("*.json")):
        keys = json.loads(record.read_text())["keys"]
        if len(keys) == batch:
            times.append(record.stat().st_mtime_ns)
            counts.append(len(keys))
    return times, counts


def file_outputs(folder: Path) -> tuple[list[int], list[int]]:
    files = sorted(folder.glob("*.safetensors"))
    return [f.stat().st_mtime_ns for f in files], [1] * len(files)


def bench_throughput(
    base_config: Path,
    model: Path,
    raw: Path,
    work: Path,
    rounds: int,
    threads: int,
    repeats: int = 8,
    workers: int = 1,
    batch: int = 8,
    launch=popen,
) -> dict:
    """`rounds` x every side in a fresh process over `repeats` copies of the raw tars; rows compare
    steady-state seconds per sample (start-up excluded, see steady_rate). `launch` starts the processes
    (bench_common.popen)."""
    corpus = make_corpus(raw, work / "corpus", repeats)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for round_index in range(rounds):
        order = SIDES[round_index % len(SIDES) :] + SIDES[: round_index % len(SIDES)]
        for side in order:
            run_dir = work / f"{side}-{round_index}"
            shutil.rmtree(run_dir, ignore_errors=True)
            side_workers = workers if side == "service" else 0  # encode-only must run in-process
            config = write_run_config(
                base_config,
                run_dir.with_suffix(".toml"),
                throughput_overrides(model, corpus, run_dir, run_dir / "window", side_workers, batch),
            )
            _, _, text = run_timed(
                [sys.executable, __file__, "--child", side, str(config)],
                work / f"{side}-{round_index}.log",
                threads,
                timeout=900,
                launch=launch,
            )
            result = json.loads(text.strip().splitlines()[-1])
            outputs = file_outputs(run_dir / "naive") if side == "naive" else window_outputs(run_dir / "window", batch)
            result["s_per_sample"], result["steady_samples"] = steady_rate(*outputs)
            runs[side].append(result)
    per_sample = {side: median([r["s_per_sample"] for r in results]) for side, results in runs.items()}
    samples = runs["service"][0]["samples"]
    if any(r["samples"] != samples for results in runs.values() for r in results):
        raise RuntimeError(
            f"the sides committed different sample counts: "
            f"{ {side: [r['samples'] for r in results] for side, results in runs.items()} }"
        )
    service, naive, encode = per_sample["service"], per_sample["naive"], per_sample["encode_only"]
    rows = [
        Row(
            "precompute s/sample vs naive loop",
            service,
            "s",
            baseline=naive,
            max_ratio=round(1 / GOAL_VS_NAIVE, 3),
            note=f"steady state over {samples} samples; goal: {GOAL_VS_NAIVE:g}x the naive samples/s",
        ),
        Row(
            "precompute s/sample vs encode-only",
            service,
            "s",
            baseline=encode,
            max_ratio=round(1 / GOAL_VS_ENCODE, 3),
            note=f"goal: {GOAL_VS_ENCODE:g}x the samples/s of encoding alone",
        ),
        Row("  precompute samples/s: service", 1 / service, "/s"),
        Row("  precompute samples/s: naive loop", 1 / naive, "/s"),
        Row("  precompute samples/s: encode-only", 1 / encode, "/s"),
    ]
    return {
        "rows": rows,
        "s_per_sample": per_sample,
        "runs": runs,
        "samples": samples,
        "settings": {"repeats": repeats, "workers": workers, "batch": batch, "rounds": rounds},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("child_config", nargs="?", type=Path, help=argparse.SUPPRESS)
    asset_arguments(parser, ROOT / "runs/bench-throughput")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side")
    parser.add_argument("--repeats", type=int, default=8, help="copies of the raw tars in the corpus")
    parser.add_argument("--workers", type=int, default=1, help="the service's decode workers")
    parser.add_argument("--batch", type=int, default=8, help="samples per shard and per VAE batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (0: torch's default)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.child_config)))
        return 0
    for name in ("rounds", "repeats", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not (args.model / "model_index.json").exists() or not sorted(args.raw.glob("*.tar")):
        parser.error(f"missing {args.model} or the tars in {args.raw}: build them with `make assets`")
    shutil.rmtree(args.out, ignore_errors=True)
    result = bench_throughput(
        args.config, args.model, args.raw, args.out, args.rounds, args.threads, args.repeats, args.workers, args.batch
    )
    print(format_table(result["rows"]))
    print(json.dumps({"s_per_sample": result["s_per_sample"], "settings": result["settings"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
