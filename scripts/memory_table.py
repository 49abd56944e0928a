"""docs/memory.md's tables: `vt-train plan` for the models people train, from their real configs alone.

For each model of scripts/real_models.json a config-only folder is made: the family's tiny preset with
every model component's config.json replaced by the real one and no weights at all (the plan reads
configs only; the tiny tokenizers stand in, text lengths are the family pipelines'). Then the plan of a
LoRA (rank 32) and a full fine-tune (bf16 weights, AdamW, batch 1 per GPU, activation checkpointing)
at the model's usual bucket, on one GPU and on 8 (FSDP2), and the settings that make a one-GPU run fit
in 24, 48 and 80 GB.

    python scripts/memory_table.py [--out docs/memory.md] [--work runs/memory-table] [--only wan2.1-14b]

With --only, the other models' tables already in the file are kept; the file is rewritten after each model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
REAL = json.loads((ROOT / "scripts" / "real_models.json").read_text())
GIB = 2**30
# model -> (title, bucket, extra model settings)
MODELS = {
    "wan2.1-14b": ("Wan 2.1 T2V 14B", "81x480x832", {}),
    "wan2.2-t2v-a14b": ("Wan 2.2 T2V A14B, both experts", "81x480x832", {"expert": "all"}),
    "hunyuanvideo": ("HunyuanVideo", "61x544x960", {}),
    "hunyuanvideo1.5-480p-t2v": ("HunyuanVideo 1.5 (480p)", "121x480x848", {}),
    "ltx2": ("LTX-2 (video stream)", "121x512x768", {}),
    "cogvideox-5b": ("CogVideoX 5B", "49x480x720", {}),
}
BUDGETS = (24, 48, 80)
MARKER = "<!-- everything below is written by scripts/memory_table.py -->"


def config_only_model(key: str, folder: Path) -> Path:
    """The family's tiny preset with `key`'s real component configs and no weights."""
    from make_tiny_model import make_tiny_model

    entry = REAL[key]
    if (folder / ".done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    make_tiny_model(entry["family"], folder, seed=0)
    for name, component in entry["components"].items():
        part = folder / name
        for weights in part.glob("*.safetensors*"):
            weights.unlink()
        if component["library"] == "transformers":
            import transformers

            getattr(transformers, component["config_class"])(**component["config"]).save_pretrained(part)
        else:
            config = json.loads((part / "config.json").read_text())
            config.update(component["config"])
            (part / "config.json").write_text(json.dumps(config, indent=1))
    (folder / ".done").write_text("ok\n")
    return folder


def run_config(folder: Path, key: str, mode: str, gpus: int):
    from vt.shared.config import Config, build

    _, bucket, model = MODELS[key]
    tree = {"model": {"family": REAL[key]["family"], "path": str(folder), "dtype": "bfloat16", **model},
            "buckets": {"sizes": [bucket], "fps": 16.0},
            "train": {"mode": mode, "lora_rank": 32, "lora_alpha": 32.0, "batch_size": gpus,
                      "validation_prompts": ["a red fox running through fresh snow"]},
            "parallel": {"activation_checkpointing": True}}
    return build(Config, tree)


def table(key: str, folder: Path) -> str:
    from vt.train.plan import alternatives, make_plan

    title, bucket, _ = MODELS[key]
    lines = [f"### {title}, {bucket}", "",
             "| mode | GPUs | weights | grads + optimizer | buffers | activations (AC on / off) | validation | "
             "per GPU | fits 24 / 48 / 80 GB? | one GPU: single changes that fit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    stage1 = None
    for mode in ("lora", "full"):
        for gpus in (1, 8):
            config = run_config(folder, key, mode, gpus)
            plan = make_plan(config, gpus, "cuda")
            rank = plan.rank
            worst = max(plan.activations.values(), key=lambda a: a["none"])
            fits = " / ".join("yes" if rank.device_total <= budget * 1e9 else "no" for budget in BUDGETS)
            changes = ""
            if gpus == 1:
                options = alternatives(config, 1, "cuda")
                changes = "; ".join(
                    f"{budget} GB: " + (", ".join(label for label, alt in options
                                                    if alt.rank.device_total <= budget * 1e9) or "none")
                    for budget in BUDGETS if rank.device_total > budget * 1e9) or "-"
            lines.append(f"| {mode} | {gpus} | {_g(rank.weights)} | {_g(rank.gradients + rank.optimizer)} | "
                         f"{_g(rank.buffers)} | {_g(worst['checkpointing'])} / {_g(worst['none'])} | "
                         f"{_g(rank.validation)} | **{_g(rank.device_total)}** | {fits} | {changes} |")
            stage1 = plan.stage1
    encoders = ", ".join(f"{name} {_g(size)}" for name, size in stage1.items() if name != "working")
    lines += ["", f"Stage 1, per producer: {encoders} (bf16), plus {_g(stage1['working'])} for the VAE to encode "
                  f"one {bucket} clip.", ""]
    return "\n".join(lines)


def _g(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "memory.md",
                        help="written after its MARKER line (the text above it stays)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "memory-table")
    parser.add_argument("--only", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    text = args.out.read_text() if args.out.is_file() else MARKER
    head, _, tables = text.partition(MARKER)
    sections = kept_sections(tables)  # a model not in --only keeps its table
    for key in args.only:
        folder = config_only_model(key, args.work / key)
        sections[MODELS[key][0]] = table(key, folder)
        print(sections[MODELS[key][0]], flush=True)
        ordered = [sections[title] for title, *_ in MODELS.values() if title in sections]
        args.out.write_text(head + MARKER + "\n\n" + "\n".join(ordered))  # after each model: a long run keeps its work
    print(f"written to {args.out}")


def kept_sections(tables: str) -> dict[str, str]:
    """model title -> its table section, from what the script wrote before (each starts "### <title>, ")."""
    sections = {}
    for part in ("\n" + tables).split("\n### ")[1:]:
        title = next((t for t, *_ in MODELS.values() if part.startswith(f"{t}, ")), None)
        if title:
            sections[title] = "### " + part.rstrip("\n") + "\n"
    return sections


if __name__ == "__main__":
    main()
