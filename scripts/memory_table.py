"""docs/memory.md's tables: `vt-train plan` for the models people train, from their real configs alone.

For each model of scripts/real_models.json a config-only folder is made: the family's tiny preset with
every model component's config.json replaced by the real one and no weights at all (the plan reads
configs only; the tiny tokenizers stand in, text lengths are the family pipelines'). Then the plan of a
LoRA (rank 32) and a full fine-tune (bf16 weights, AdamW, batch 1 per GPU, activation checkpointing)
at the model's usual bucket, on one GPU and on 8 (FSDP2), and the settings that make a one-GPU run fit
in 24, 32, 48 and 80 GiB (cards are sold as "GB" but hold GiB: a 24 GB card has 24 GiB). Each card's plan decides "auto" VAE tiling against that card; stage 1's line gives each
producer's peak with the text encoders beside the VAE and in a phase of their own.

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
# model -> (title, bucket, extra model settings, frame rate)
MODELS = {
    "wan2.1-14b": ("Wan 2.1 T2V 14B", "81x480x832", {}, 16.0),
    "wan2.2-t2v-a14b": ("Wan 2.2 T2V A14B, both experts", "81x480x832", {"expert": "all"}, 16.0),
    "hunyuanvideo": ("HunyuanVideo", "61x544x960", {}, 16.0),
    "hunyuanvideo1.5-480p-t2v": ("HunyuanVideo 1.5 (480p)", "121x480x848", {}, 16.0),
    "ltx2": ("LTX-2 (video stream)", "121x512x768", {}, 16.0),
    "cogvideox-5b": ("CogVideoX 5B", "49x480x720", {}, 16.0),
    "minimax-h3": ("MiniMax H3 (video and sound)", "124x768x1344", {"audio": True}, 24.0),
    "kandinsky6-lite": ("Kandinsky 6 Lite (video and sound)", "121x480x864", {"audio": True}, 24.0),
    "kandinsky6-pro": ("Kandinsky 6 Pro (video and sound)", "121x480x864", {"audio": True}, 24.0),
}
# A variant diffusers has no class for, planned from its base: the released H3 with its AdaLN input projections
# (`adaln_proj.linear`, 2688 wide) reduced to the 8 columns the timestep can reach (multimodalart/MiniMax-H3-Pruned:
# 33.14B -> 20.11B parameters per DiT); activations and validation are the base's.
PRUNED = {"minimax-h3": ("MiniMax H3 pruned (20B)", "adaln_proj.linear.weight", 8)}
BUDGETS = (24, 32, 48, 80)
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

    _, bucket, model, fps = MODELS[key]
    tree = {
        "model": {"family": REAL[key]["family"], "path": str(folder), "dtype": "bfloat16", **model},
        "buckets": {"sizes": [bucket], "fps": fps},
        "train": {
            "mode": mode,
            "batch_size": gpus,
        },
        "adapter": {"rank": 32, "alpha": 32.0},
        "validation": {"prompts": ["a red fox running through fresh snow"]},
        "parallel": {"activation_checkpointing": True},
    }
    return build(Config, tree)


def table(key: str, folder: Path) -> str:
    from vt.train.plan import make_plan
    from vt.train.plan_search import alternatives

    title, bucket, *_ = MODELS[key]
    lines = [
        f"### {title}, {bucket}",
        "",
        "| mode | GPUs | weights | grads + optimizer | buffers | activations (AC on / off) | validation "
        "(decode untiled / tiled) | per GPU (80 GiB card) | host | fits 24 / 32 / 48 / 80 GiB? | one GPU: what fits "
        "(alone or in pairs), under the smallest card each fits, with the host memory it needs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pruned = []
    for mode in ("lora", "full"):
        for gpus in (1, 8):
            config = run_config(folder, key, mode, gpus)
            plans = {budget: make_plan(config, gpus, "cuda", budget=budget * GIB) for budget in BUDGETS}
            plan = plans[80]
            rank = plan.rank
            worst = max(plan.activations.values(), key=lambda a: a["none"])
            fits = " / ".join("yes" if plans[b].rank.device_total <= b * GIB else "no" for b in BUDGETS)
            changes = ""
            failing = [budget for budget in BUDGETS if plans[budget].rank.device_total > budget * GIB]
            if gpus == 1 and failing:  # planned once, against the smallest card ("auto" tiling tiles most there)
                changes = _by_smallest_card(alternatives(config, 1, "cuda", None), failing)
            elif gpus == 1:
                changes = "-"
            lines.append(
                f"| {mode} | {gpus} | {_g(rank.weights)} | {_g(rank.gradients + rank.optimizer)} | "
                f"{_g(rank.buffers)} | {_g(worst['checkpointing'])} / {_g(worst['none'])} | "
                f"{_validation(plans)} | **{_g(rank.device_total)}** | {_g(rank.host_peak)} | {fits} | "
                f"{changes} |"
            )
            if key in PRUNED:
                pruned.append(_pruned_row(key, config, mode, gpus, plan))
    lines += ["", _stage1(key, folder), ""]
    if pruned:
        name, *_ = PRUNED[key]
        lines += [
            f"### {name}, {bucket} (estimated from the base's plan)",
            "",
            "| mode | GPUs | weights | grads + optimizer | per GPU (80 GiB card) | fits 24 / 32 / 48 / 80 GiB? |",
            "| --- | --- | --- | --- | --- | --- |",
            *pruned,
            "",
        ]
    return "\n".join(lines)


def _by_smallest_card(options, cards: list[int]) -> str:
    """ "24 GiB: a (host 13.1 GiB), b (...); 48 GiB: c ...": what fits each of `cards` (the cards the row does not fit
    as it is), minimal (a pair whose one change fits alone is left out), quickest first, each listed once under the
    smallest card it fits (it fits the larger ones too), with the host memory it needs; "none" where nothing fits."""
    from vt.train.step_cost import step_seconds

    listed, done = {card: [] for card in cards}, set()
    for card in cards:
        fits = {label: plan for label, plan in options if plan.rank.device_total <= card * GIB}
        minimal = [
            label
            for label in fits
            if not any(other != label and set(other.split(" + ")) < set(label.split(" + ")) for other in fits)
        ]
        for label in sorted(minimal, key=lambda name: step_seconds(fits[name]) or 0.0):
            if label not in done:
                done.add(label)
                listed[card].append(f"{label} (host {_g(fits[label].rank.host_peak)})")
    return "; ".join(f"{card} GiB: {', '.join(labels)}" for card, labels in listed.items() if labels) or "none"


def _validation(plans) -> str:
    """The validation phase on an 80 GiB card, with the decode's untiled / tiled peaks (tiled where traced)."""
    parts = plans[80].validation
    tiled = next((p.validation["decode_tiled"] for p in plans.values() if "decode_tiled" in p.validation), None)
    decode = f"{_g(parts['decode'])} / {_g(tiled) if tiled is not None else 'not needed'}"
    return f"{_g(plans[80].rank.validation)}{' (tiled)' if plans[80].vae_tiled else ''}: {decode}"


def _stage1(key: str, folder: Path) -> str:
    """Each producer's encoders, the VAE's work untiled and tiled, and the peak with the text encoders beside the
    VAE or in a phase of their own (`precompute.text_encoder_offload = "model"`)."""
    from vt.train.plan import make_plan

    _, bucket, *_ = MODELS[key]
    config = run_config(folder, key, "lora", 1)

    def with_pre(**values):
        return config.model_copy(update={"precompute": config.precompute.model_copy(update=values)})

    tiled = make_plan(with_pre(vae_tiling=True), 1, "cuda")
    untiled = make_plan(with_pre(vae_tiling=False), 1, "cuda")
    apart = make_plan(with_pre(vae_tiling=False, text_encoder_offload="model"), 1, "cuda")
    apart_tiled = make_plan(with_pre(vae_tiling=True, text_encoder_offload="model"), 1, "cuda")
    encoders = ", ".join(
        f"{name} {_g(size)}" for name, size in untiled.stage1.items() if not name.startswith("working")
    )
    return (
        f"Stage 1, per producer: {encoders} (bf16); the VAE encoding one {bucket} clip works in "
        f"{_g(untiled.stage1['working'])} untiled, {_g(tiled.stage1['working_tiled'])} tiled. Peak per producer: "
        f"{_g(untiled.stage1_peak())} untiled / {_g(tiled.stage1_peak())} tiled with the text encoders beside the "
        f"VAE; {_g(apart.stage1_peak())} / {_g(apart_tiled.stage1_peak())} with `precompute.text_encoder_offload = "
        f'"model"` (the text phase apart).'
    )


def _pruned_row(key: str, config, mode: str, gpus: int, plan) -> str:
    """The base's plan less what the pruned layers drop: each `adaln_proj.linear` weight's columns beyond the
    kept ones, in every line that holds the transformer's weights (and, in a full fine-tune, their gradients and
    AdamW moments), over the ranks FSDP2 shards them across."""
    from vt.shared.models import spec_for

    _, suffix, kept = PRUNED[key]
    transformer = spec_for(config).empty_component("transformer")
    dropped = sum(
        p.numel() * (1 - kept / p.shape[1]) for name, p in transformer.named_parameters() if name.endswith(suffix)
    )
    total = sum(p.numel() for p in transformer.parameters())
    share = dropped / total
    rank = plan.rank
    weights = rank.weights * (1 - share)
    trained = (rank.gradients + rank.optimizer) * (1 - share if mode == "full" else 1)
    per_gpu = rank.device_total - (rank.weights - weights) - (rank.gradients + rank.optimizer - trained)
    fits = " / ".join("yes" if per_gpu <= budget * GIB else "no" for budget in BUDGETS)
    return f"| {mode} | {gpus} | {_g(weights)} | {_g(trained)} | **{_g(per_gpu)}** | {fits} |"


def _g(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "memory.md",
        help="written after its MARKER line (the text above it stays)",
    )
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
    """model title -> its table section, from what the script wrote before (each starts "### <title>, "; a
    section of no model's title, a variant's, belongs to the model before it)."""
    sections, title = {}, None
    for part in ("\n" + tables).split("\n### ")[1:]:
        title = next((t for t, *_ in MODELS.values() if part.startswith(f"{t}, ")), title)
        if title:
            sections[title] = (
                sections.get(title, "") + ("\n" if title in sections else "") + "### " + part.rstrip("\n") + "\n"
            )
    return sections


if __name__ == "__main__":
    main()
