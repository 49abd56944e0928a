"""LoRA files in the form ComfyUI and most community tools load: the model's original module names.

diffusers names a Wan self-attention query `blocks.0.attn1.to_q`; the original checkpoint, and so
ComfyUI, calls it `blocks.0.self_attn.q`. A LoRA saved under diffusers names gives ComfyUI "lora key
not loaded". So every LoRA export also writes this file:

    diffusion_model.<original module>.lora_A.weight   (rank, in)
    diffusion_model.<original module>.lora_B.weight   (out, rank)
    diffusion_model.<original module>.alpha           (scalar), where the family's loaders read it

Each family gives its key table (`ModelSpec.original_names`): (regular expression over the
diffusers module name, replacement), first full match wins. Where a family's loaders do not take
`.alpha` (diffusers' LTX-Video conversion refuses the key), the scale alpha / rank is multiplied
into lora_B instead and no alpha is written: every loader then applies scale 1 and gets the same
weights. diffusers' own conversion of such files (`load_lora_weights`) is what the tests load them
with.

Where the original model fuses several diffusers modules into one (HunyuanVideo's q, k and v are
one `img_attn_qkv`), a family lists `Fused` entries: the parts' rank-r LoRAs become one LoRA of rank
(number of parts trained) x r on the fused module, A = cat(A_part) and B = block_diag(B_part), so B A
stacks each part's own B_part A_part in the fused output; a part without a LoRA gets zero rows.
`diffusers_state_dict` reads such a file back (tables reversed, fused LoRAs split by `split_fused`).
tests/shared/test_comfy_keys.py checks every family's file against ComfyUI's own key map and LoRA
arithmetic (tests/helpers/comfy_reference.py, re-implemented from ComfyUI's source).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PREFIX = "diffusion_model."


def filename(expert: str | None = None) -> str:
    """lora_comfyui.safetensors, or lora_comfyui_<expert>.safetensors for one expert of several
    (ComfyUI loads one file per expert model)."""
    return f"lora_comfyui_{expert}.safetensors" if expert else "lora_comfyui.safetensors"


def original_module(module: str, table: Sequence[tuple[str, str]]) -> str | None:
    """The original name of a diffusers module name, by the first pattern that matches it whole."""
    for pattern, replacement in table:
        if re.fullmatch(pattern, module):
            return re.sub(f"^{pattern}$", replacement, module)
    return None


@dataclass(frozen=True)
class Fused:
    """Diffusers modules `<prefix>.<part>` that are one original module, their outputs stacked in
    `parts` order; `original` is the replacement for `prefix` (a regular expression matched whole)."""

    prefix: str
    parts: tuple[str, ...]
    original: str

    def match(self, module: str) -> tuple[str, str] | None:
        """(the module's prefix, its part) if it is one of this entry's parts, else None."""
        for part in self.parts:
            if module.endswith("." + part) and re.fullmatch(self.prefix, module[: -len(part) - 1]):
                return module[: -len(part) - 1], part
        return None


def templated(pairs: Sequence[tuple[str, str]], reverse: bool = False) -> tuple[tuple[str, str], ...]:
    """A key table from name templates with `{}` for the block index (("transformer_blocks.{}.attn.to_out.0",
    "double_blocks.{}.img_attn_proj"), ...): (regular expression matched whole, replacement) from the diffusers name
    to the original one or, `reverse`, back (what `diffusers_state_dict` takes)."""
    table = []
    for source, target in ((t, s) if reverse else (s, t) for s, t in pairs):
        table.append((re.escape(source).replace(r"\{\}", r"(\d+)"), target.replace("{}", r"\1")))
    return tuple(table)


def fused_templates(entries: Sequence[tuple[str, tuple[str, ...], str]], reverse: bool = False) -> tuple:
    """(diffusers prefix template, parts, original template) entries as `Fused` (export) or, `reverse`, as
    `diffusers_state_dict` takes them: (regular expression over the original module, diffusers prefix, parts)."""
    out = []
    for prefix, parts, original in entries:
        ((pattern, replacement),) = templated([(prefix, original)], reverse=reverse)
        out.append((pattern, replacement, parts) if reverse else Fused(pattern, parts, replacement))
    return tuple(out)


def comfy_state_dict(
    lora: dict[str, Tensor],
    table: Sequence[tuple[str, str]],
    rank: int,
    alpha: float,
    write_alpha: bool,
    fused: Sequence[Fused] = (),
    out_features: Callable[[str], int] | None = None,
) -> dict[str, Tensor]:
    """peft/diffusers LoRA keys (`<module>.lora_A.weight`) -> `diffusion_model.<original>.lora_A.weight`.

    `fused` entries merge their parts' LoRAs into one (see the module docstring); `out_features(module)`
    gives the output size of a part that has no LoRA (its zero rows). Raises ValueError naming the
    modules the table has no original name for.
    """
    out: dict[str, Tensor] = {}
    unmapped: set[str] = set()
    groups: dict[tuple[int, str], dict[str, dict[str, Tensor]]] = {}
    for key, tensor in lora.items():
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise ValueError(f"{key!r} is not a LoRA weight (<module>.lora_A.weight or .lora_B.weight)")
        tensor = tensor.detach().to("cpu", torch.float32)
        original = original_module(module, table)
        if original is None:
            found = next(((i, hit) for i, entry in enumerate(fused) if (hit := entry.match(module))), None)
            if found is None:
                unmapped.add(module)
            else:
                (index, (prefix, piece)) = found
                groups.setdefault((index, prefix), {}).setdefault(piece, {})[part[0]] = tensor
            continue
        if part == "B.weight" and not write_alpha:
            tensor = tensor * (alpha / rank)
        out[f"{PREFIX}{original}.lora_{part}"] = tensor.contiguous()
        if write_alpha:
            out[f"{PREFIX}{original}.alpha"] = torch.tensor(float(alpha))
    if unmapped:
        raise ValueError(
            f"no original module name for {sorted(unmapped)[:4]} (LoRA on modules outside the "
            "family's key table); the ComfyUI file is not written"
        )
    for (index, prefix), parts in groups.items():
        entry = fused[index]
        original = re.sub(f"^{entry.prefix}$", entry.original, prefix)
        present = [p for p in entry.parts if p in parts]
        if any(set(parts[p]) != {"A", "B"} for p in present):
            raise ValueError(f"{prefix}: a fused part has lora_A without lora_B or the reverse")
        blocks = []
        for piece in entry.parts:
            if piece in parts:
                blocks.append(parts[piece]["B"])
            elif out_features is None:
                raise ValueError(f"{prefix}.{piece} has no LoRA and its size is unknown: cannot fuse into {original}")
            else:
                blocks.append(torch.zeros(out_features(f"{prefix}.{piece}"), 0))
        lora_a = torch.cat([parts[p]["A"] for p in present], dim=0)
        lora_b = torch.block_diag(*blocks)
        if not write_alpha:
            lora_b = lora_b * (alpha / rank)
        out[f"{PREFIX}{original}.lora_A.weight"] = lora_a.contiguous()
        out[f"{PREFIX}{original}.lora_B.weight"] = lora_b.contiguous()
        if write_alpha:  # rank len(present) * r: the same scale alpha / r
            out[f"{PREFIX}{original}.alpha"] = torch.tensor(float(alpha) * len(present))
    return out


def split_fused(lora_a: Tensor, lora_b: Tensor, sizes: Sequence[int]) -> list[tuple[Tensor, Tensor] | None]:
    """A fused module's LoRA (lora_B (sum(sizes), R), lora_A (R, in)) as one (lora_A, lora_B) per part,
    exactly: part i gets lora_B's rows of that part and, of the R columns, those non-zero in these rows
    (with lora_A's matching rows). For a file `comfy_state_dict` wrote (lora_B block diagonal) that is
    each part's own LoRA; a part whose rows are all zero (not trained) gets None."""
    if lora_b.shape[0] != sum(sizes) or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(
            f"a fused LoRA of lora_B {tuple(lora_b.shape)}, lora_A {tuple(lora_a.shape)} does not "
            f"split into parts of {list(sizes)} outputs"
        )
    out: list[tuple[Tensor, Tensor] | None] = []
    for rows in torch.split(lora_b, list(sizes)):
        used = rows.ne(0).any(0)
        out.append((lora_a[used].contiguous(), rows[:, used].contiguous()) if used.any() else None)
    return out


def diffusers_state_dict(
    state: dict[str, Tensor],
    table: Sequence[tuple[str, str]],
    fused: Sequence[tuple[str, str, tuple[str, ...]]] = (),
    out_features: Callable[[str], int] | None = None,
) -> dict[str, Tensor]:
    """A ComfyUI file without `.alpha` (the scale in lora_B) -> peft keys `<module>.lora_A.weight`, scale 1.

    `table`: (regular expression over the original module, diffusers replacement), first full match
    wins; `fused`: (regular expression over an original fused module, the diffusers prefix it stands for,
    the parts in output order), each split by `split_fused` with the parts' sizes `out_features(module)`.
    Raises ValueError naming a key that is not a LoRA weight of a module either knows.
    """
    modules: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state.items():
        module, sep, part = key.removeprefix(PREFIX).rpartition(".lora_")
        if not key.startswith(PREFIX) or not sep or part not in ("A.weight", "B.weight"):
            raise ValueError(f"{key!r} is not a LoRA weight ({PREFIX}<module>.lora_A.weight or .lora_B.weight)")
        modules.setdefault(module, {})[part[0]] = tensor
    out: dict[str, Tensor] = {}
    for module, lora in modules.items():
        if set(lora) != {"A", "B"}:
            raise ValueError(f"{module}: lora_A without lora_B or the reverse")
        name = original_module(module, table)
        if name is not None:
            out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = lora["A"], lora["B"]
            continue
        entry = next((entry for entry in fused if re.fullmatch(entry[0], module)), None)
        if entry is None or out_features is None:
            raise ValueError(f"{module!r} is not a module the key table knows")
        pattern, prefix, parts = entry
        names = [f"{re.sub(f'^{pattern}$', prefix, module)}.{part}" for part in parts]
        for name, split in zip(names, split_fused(lora["A"], lora["B"], [out_features(n) for n in names])):
            if split is not None:
                out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = split
    return out
