"""`make bench`, memory rows: host memory of whole training runs at real size, against the bf16 weights.

The model: the Wan 2.1 T2V 1.3B transformer at its real config (1.42B parameters, scripts/real_models.json)
with random weights saved in bf16 diffusers layout, a 1-layer UMT5 of the real width (4096) as text
encoder, which only stage 1 loads, the tiny preset's Wan VAE (a real VAE config convolves in bfloat16 at
minutes per clip on CPUs without bf16 instructions) and the tiny preset's tokenizer and scheduler.
The data: the demo raw shards, one bucket, precomputed once into a kept window.

Every run is a whole `vt-train run` (an optimizer step of a global batch of 4, a checkpoint, validation with
one prompt, export), and each rank reports its peak resident set in <run>/memory.json:

    LoRA, one process          goal: <= 1.3x the bf16 weights
    LoRA, FSDP2 over 2 ranks   goal: the largest rank <= 0.6x the one-process run
    LoRA, FSDP2 over 4 ranks   goal: the largest rank <= 0.35x the one-process run
    full, FSDP2 over 2 ranks   goal: each rank <= 0.6x the one-process figure `vt-train plan` gives
                               (2 x ~12 GiB at 30 blocks: on a smaller host, as many blocks of the same
                               width as fit, and the row says so)
    LoRA, one process, on the transformer quantized to a Q8_0 GGUF file and to int8 (scripts/quantize_base.py,
    kept as stored: train/packed_base.py)   goal: <= 0.75x the bf16 base's one-process run
    LoRA, one process, the bf16 base quantized to NF4 as it is read (frozen_base.quantize)   goal: <= 0.6x
    `vt-train plan --device cpu` for each row: within 15% of the measured peak

Peaks are the runs' own (the process's resident set at its highest), less the resident set the process
had before it built anything (interpreter, torch, diffusers, transformers, peft: ~0.4 GiB, the same for
any training script); both are printed. Also: the two ways of filling a sharded model (each rank reads
its slices / rank 0 reads and scatters), start-up seconds and peak at 2 ranks.

    python scripts/bench_memory.py [--out runs/bench/memory] [--skip-full | --only-full | --only-quantized]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_common import ROOT, Row, format_table, machine  # noqa: E402

GIB = 2**30
BIN = Path(sys.executable).parent
REAL = json.loads((ROOT / "scripts" / "real_models.json").read_text())["wan2.1-1.3b"]
PROMPT = "a red fox running through fresh snow, cinematic"


def build_model(folder: Path) -> Path:
    """The bench model in diffusers layout (built once; ~1 minute and 5 GB of disk)."""
    if (folder / ".done").is_file():
        return folder
    import torch
    from diffusers import WanTransformer3DModel
    from make_tiny_model import make_tiny_model
    from transformers import UMT5Config, UMT5EncoderModel

    shutil.rmtree(folder, ignore_errors=True)
    make_tiny_model("wan", folder, seed=0)  # model_index.json, tokenizer, scheduler, the tiny VAE
    for name in ("transformer", "text_encoder"):
        shutil.rmtree(folder / name)
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**REAL["components"]["transformer"]["config"])
    transformer.to(torch.bfloat16).save_pretrained(folder / "transformer", safe_serialization=True)
    del transformer
    text = dict(REAL["components"]["text_encoder"]["config"], num_layers=1)
    UMT5EncoderModel(UMT5Config(**text)).to(torch.bfloat16).save_pretrained(
        folder / "text_encoder", safe_serialization=True
    )
    (folder / ".done").write_text("ok\n")
    return folder


def build_shallow_transformer(folder: Path, layers: int) -> Path:
    """The same transformer config with `layers` of its blocks (the real width), random bf16 weights."""
    if (folder / ".done").is_file():
        return folder
    import torch
    from diffusers import WanTransformer3DModel

    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    config = dict(REAL["components"]["transformer"]["config"], num_layers=layers)
    WanTransformer3DModel(**config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    (folder / ".done").write_text("ok\n")
    return folder


def build_quantized(model: Path, out: Path, kind: str) -> Path:
    """The bench transformer (diffusers layout) as one quantized file: `kind` "Q8_0" (GGUF) or "int8"."""
    from quantize_base import write_gguf, write_int8

    from vt.shared.weights.folder import Weights

    file = out / (f"transformer-{kind}.gguf" if kind != "int8" else "transformer-int8.safetensors")
    if not file.is_file():
        weights = Weights.in_folder(model / "transformer")
        tensors = {name: weights.read(name) for name in weights.names()}
        partial = file.with_name(file.name + ".partial")
        if kind == "int8":
            write_int8(tensors, partial)
        else:
            write_gguf(tensors, partial, kind)
        partial.rename(file)
    return file


def in_child(function, *args):
    """`function(*args)` in a spawned child process (its memory never counts in this process's peak); its result."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def bf16_weights_bytes(folder: Path) -> int:
    from vt.shared.weights.folder import Weights

    weights = Weights.in_folder(folder / "transformer")
    return sum(entry.end - entry.start for entry in weights.entries.values())


def write_config(
    path: Path,
    model: Path,
    raw: Path,
    window: Path,
    run: Path,
    transformer: Path | None = None,
    sections: dict | None = None,
    **train,
) -> Path:
    from vt.shared.config import Config, build, to_toml

    tree = {
        "run": {"dir": str(run)},
        # 64 text tokens (Wan's pipeline encodes 512, mostly padding): the cross-attention over them is most of
        # a step's work at this bucket, and its memory is a sliver of the weights'.
        "model": {
            "family": "wan",
            "path": str(model),
            "dtype": "bfloat16",
            "max_text_tokens": 64,
            **({"components": {"transformer": str(transformer)}} if transformer else {}),
        },
        "data": {"raw": str(raw)},
        "buckets": {"sizes": ["9x64x96"], "fps": 8.0},
        "window": {"uri": str(window), "size": "keep", "poll_seconds": 0.05},
        "precompute": {"workers": 0, "samples_per_shard": 4, "encode_batch": 4},
        # mixed_precision "auto": on a CPU, float32 compute (bf16 matmuls without bf16 instructions run ~100x
        # slower), the frozen bf16 layers upcast one at a time, as the trainer does there.
        "train": {
            "mode": "lora",
            "batch_size": 4,
            "max_steps": 1,
            "lr": 1e-4,
            "checkpoint_every": 0,
            **train,
        },
        "validation": {"prompts": [PROMPT], "steps": 1},
        **(sections or {}),
        "parallel": {"activation_checkpointing": True, "dp_shard": -1},  # FSDP2, as `vt-train plan` plans it
        "log": {"progress": False},
    }
    path.write_text(to_toml(build(Config, tree)))
    return path


def run_trainer(config: Path, ranks: int, log: Path) -> dict:
    """One whole run; returns its memory.json and wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
    if ranks == 1:
        args = [str(BIN / "vt-train"), "run", str(config)]
    else:
        args = [
            str(BIN / "torchrun"),
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "vt.train",
            "run",
            str(config),
        ]
    started = time.perf_counter()
    with open(log, "wb") as out:
        code = subprocess.call(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise RuntimeError(f"{' '.join(args[:4])} exited with {code}; see {log}:\n{log.read_text()[-3000:]}")
    from vt.shared.config import load_config

    memory = json.loads((load_config(config).run_dir / "memory.json").read_text())
    return {**memory, "seconds": time.perf_counter() - started}


def planned(config: Path, ranks: int) -> int:
    """`vt-train plan --device cpu --json`'s total per rank, in bytes."""
    out = subprocess.run(
        [str(BIN / "vt-train"), "plan", str(config), "--gpus", str(ranks), "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)["per_rank_bytes"]["total"]


def bench_fill(config: Path, work: Path) -> list[dict]:
    """Start-up of a 2-rank FSDP2 LoRA model built both ways (scripts/bench_fill_worker.py)."""
    rows = []
    for how in ("slices", "rank0"):
        log = work / f"fill-{how}.log"
        out = work / f"fill-{how}.json"
        with open(log, "wb") as handle:
            code = subprocess.call(
                [
                    str(BIN / "torchrun"),
                    "--standalone",
                    "--nproc-per-node=2",
                    str(ROOT / "scripts" / "bench_fill_worker.py"),
                    str(config),
                    how,
                    str(out),
                ],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        if code != 0:
            raise RuntimeError(f"the {how} fill failed; see {log}")
        rows.append({"how": how, **json.loads(out.read_text())})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "memory")
    parser.add_argument("--raw", type=Path, default=ROOT / "runs" / "data" / "raw")
    parser.add_argument("--skip-full", action="store_true", help="leave out the full fine-tune row")
    parser.add_argument("--only-full", action="store_true", help="the full fine-tune row (and its plan row) alone")
    parser.add_argument(
        "--only-quantized", action="store_true", help="the one-process LoRA rows alone: bf16, Q8_0 and int8 bases"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # Built in child processes: a run started from a process that grew would inherit its high-water mark in its
    # peak resident set (Linux keeps ru_maxrss across fork and exec); a child's growth does not reach its parent.
    model = in_child(build_model, args.out / "wan-1.3b")
    weights = bf16_weights_bytes(model)
    window = args.out / "window"
    runs = args.out / ("runs-full" if args.only_full else "runs-quantized" if args.only_quantized else "runs")
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir()
    if not (window / "producers").is_dir():
        # In a process of its own: a run started from a process that grew (stage 1's encoders) would inherit
        # that high-water mark in its peak resident set (Linux keeps ru_maxrss across fork and exec).
        config = write_config(args.out / "precompute.toml", model, args.raw, window, args.out / "precompute")
        subprocess.run([str(BIN / "vt-precompute"), "run", str(config)], check=True, timeout=1800)
    measured = {}
    for ranks in () if args.only_full else (1,) if args.only_quantized else (1, 2, 4):
        name = f"lora-{ranks}"
        config = write_config(runs / f"{name}.toml", model, args.raw, window, runs / name)
        measured[name] = {**run_trainer(config, ranks, runs / f"{name}.log"), "planned": planned(config, ranks)}
    for kind in () if args.only_full else ("Q8_0", "int8", "nf4"):
        name = f"lora-1-{kind}"
        config = (
            write_config(
                runs / f"{name}.toml",
                model,
                args.raw,
                window,
                runs / name,
                sections={"frozen_base": {"quantize": "nf4"}},
            )
            if kind == "nf4"
            else write_config(
                runs / f"{name}.toml",
                model,
                args.raw,
                window,
                runs / name,
                transformer=in_child(build_quantized, model, args.out, kind),
            )
        )
        measured[name] = {**run_trainer(config, 1, runs / f"{name}.log"), "planned": planned(config, 1)}
    one_plan, full_layers = 0, None
    if not (args.skip_full or args.only_quantized):
        full_layers, transformer = full_fine_tune_depth(args.out, model, args.raw, window, runs)
        full = lambda name: write_config(
            runs / f"{name}.toml",
            model,
            args.raw,
            window,
            runs / name,  # noqa: E731
            transformer=transformer,
            mode="full",
            lr=1e-5,
        )
        one_plan = planned(full("full-1"), 1)
        config = full("full-2")
        measured["full-2"] = {
            **run_trainer(config, 2, runs / "full-2.log"),
            "planned": planned(config, 2),
            "layers": full_layers,
        }
    fill = (
        []
        if args.only_full or args.only_quantized
        else bench_fill(write_config(runs / "fill.toml", model, args.raw, window, runs / "fill"), runs)
    )
    rows = rows_of(measured, weights, one_plan, fill)
    return {
        "machine": machine(),
        "weights_bytes": weights,
        "runs": measured,
        "fill": fill,
        "out": str(
            args.out
            / (
                "results-full.json"
                if args.only_full
                else "results-quantized.json"
                if args.only_quantized
                else "results.json"
            )
        ),
        "rows": [r.to_dict() for r in rows],
        "table": format_table(rows),
        "notes": [f"{r.name}: {r.note}" for r in rows if r.note],
    }


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def full_fine_tune_depth(out: Path, model: Path, raw: Path, window: Path, runs: Path) -> tuple[int, Path | None]:
    """The full fine-tune row's model: the bench transformer if 2 ranks of it fit in 70% of this host
    (float32 weights, gradients and AdamW's moments: ~16 bytes a parameter over the ranks, ~23 GiB for
    1.42B), else the same config with as many of its blocks as fit (the real width, so the ratios hold)."""
    total = REAL["components"]["transformer"]["config"]["num_layers"]
    config = write_config(runs / "full-probe.toml", model, raw, window, runs / "full-probe", mode="full")
    need = 2 * planned(config, 2)
    if need <= 0.7 * host_memory():
        return total, None
    layers = max(1, int(total * 0.7 * host_memory() / need))
    return layers, build_shallow_transformer(out / f"wan-1.3b-{layers}-blocks", layers)


def net(result: dict, rank: int) -> float:
    return (result["host_peak_gb"][rank] - result["host_baseline_gb"][rank]) * GIB


def rows_of(measured: dict, weights: int, full_one_plan: int, fill: list[dict]) -> list[Row]:
    gib = lambda value: value / GIB  # noqa: E731
    rows = []
    one = measured.get("lora-1")
    one_net = net(one, 0) if one else 0.0
    if one:
        rows.append(
            Row(
                "LoRA 1 process: peak vs bf16 weights",
                gib(one_net),
                "GiB",
                gib(weights),
                max_ratio=1.3,
                note=f"peak {one['host_peak_gb'][0]:.2f} GiB less the {one['host_baseline_gb'][0]:.2f} "
                "GiB the process held before building anything",
            )
        )
    for kind, how, goal in (
        ("Q8_0", "kept as stored", 0.75),
        ("int8", "kept as stored", 0.75),
        ("nf4", "quantized as read", 0.6),
    ):
        result = measured.get(f"lora-1-{kind}")
        if one and result:
            rows.append(
                Row(
                    f"LoRA 1 process, {kind} base {how}: peak vs the bf16 base's",
                    gib(net(result, 0)),
                    "GiB",
                    gib(one_net),
                    max_ratio=goal,
                    note=f"peak {result['host_peak_gb'][0]:.2f} GiB",
                )
            )
    for ranks, goal in ((2, 0.6), (4, 0.35)) if one and "lora-2" in measured else ():
        result = measured[f"lora-{ranks}"]
        largest = max(range(ranks), key=lambda r: net(result, r))
        rows.append(
            Row(
                f"LoRA FSDP2 {ranks} ranks: largest rank vs 1 process",
                gib(net(result, largest)),
                "GiB",
                gib(one_net),
                max_ratio=goal,
                note=f"rank {largest}; peaks {', '.join(f'{g:.2f}' for g in result['host_peak_gb'])} GiB",
            )
        )
    full = measured.get("full-2")
    if full:
        largest = max(range(2), key=lambda r: net(full, r))
        total = REAL["components"]["transformer"]["config"]["num_layers"]
        depth = "" if full["layers"] == total else f" ({full['layers']} of {total} blocks)"
        rows.append(
            Row(
                f"full FSDP2 2 ranks{depth}: largest rank vs plan's 1 process",
                gib(net(full, largest)),
                "GiB",
                gib(full_one_plan),
                max_ratio=0.6,
                note=f"rank {largest}; peaks {', '.join(f'{g:.2f}' for g in full['host_peak_gb'])} GiB"
                + (f"; {total} blocks do not fit 2 ranks in this host's memory" if depth else ""),
            )
        )
    for name, result in measured.items():
        largest = max(net(result, r) for r in range(len(result["host_peak_gb"])))
        rows.append(
            Row(
                f"vt-train plan vs measured: {name}",
                gib(result["planned"]),
                "GiB",
                gib(largest),
                max_ratio=1.15,
                min_ratio=0.85,
            )
        )
    by = {entry["how"]: entry for entry in fill}
    if not by:
        return rows
    rows.append(
        Row(
            "fill 2 ranks: rank 0 reads + scatters vs own slices",
            by["rank0"]["seconds"],
            "s",
            by["slices"]["seconds"],
            note="start-up seconds of the sharded model",
        )
    )
    rows.append(
        Row(
            "fill 2 ranks: its largest rank's peak vs own slices",
            gib(by["rank0"]["peak_bytes"]),
            "GiB",
            gib(by["slices"]["peak_bytes"]),
            note="peak resident set less the import baseline",
        )
    )
    return rows


if __name__ == "__main__":
    result = main()
    print(result["table"])
    print("\n".join(f"  {note}" for note in result["notes"]))
    out = Path(result["out"])
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"written to {out}; how to read it: docs/benchmarks.md")
