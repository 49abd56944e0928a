"""LoRA files stacked on the live transformer for a validation render (train/parts/validation_stack.py): each file's
delta added to the outputs of the modules it names, by forward hooks, for the length of one render.

No second copy and no weight changed: a hook on module M (a Linear, or peft's layer around the trained adapter of one)
adds strength x delta(x) to M's output, delta being the file's low-rank path (LoRA: B (A x) x alpha / r) or, for a
LoHa or LoKr, x times the kind's delta weight rebuilt at each call (one layer's worth, freed after it). Under FSDP2 the
hooks sit on modules inside the sharded blocks and see their activations as plain tensors: the file's factors are
whole on every rank (rank x (in + out) per module, small beside the model), on the device only during the render.
Context parallel splits the tokens, which a per-token delta does not mind; tensor parallel splits a module's input or
output, and is refused (the part's check). Pipeline stages hook the modules they hold. torch.compile'd blocks run
eagerly while the hooks are on (`set_stance("force_eager")`): dynamo does not guard on hooks, so a graph compiled
before them would skip them.

Files: vt's own export (peft names under `transformer.`, the kind and its alpha and rank in the metadata: LoRA, LoHa,
LoKr), and any file the family pipeline's `lora_state_dict` turns into such names (diffusers converts some families'
ComfyUI and musubi files so: docs/stage2.md). DoRA is refused: its magnitude rescales the whole adapted weight, which is no delta on an output.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vt.shared.adapters import MAGNITUDE, is_adapter, kind_of, module_of
from vt.shared.errors import UserError
from vt.shared.log import get_logger

log = get_logger("vt.train.stacked_lora")
PREFIX = "transformer."
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # name segments wrappers add (activation checkpointing)


@dataclass
class Delta:
    """One module's stacked adapter: `kind` ("lora", "loha", "lokr"), its factors by peft's part names (`lora_A`,
    `lora_B`, `lora_B.bias`, `hada_w1_a` ... `lokr_w2_b`) and its scale (alpha / r x the file's strength)."""

    kind: str
    factors: dict[str, Tensor]
    scale: float

    def shape(self) -> tuple[int, int]:
        """(out, in) of the weight it changes."""
        f = self.factors
        if self.kind == "lora":
            return f["lora_B"].shape[0], f["lora_A"].shape[1]
        if self.kind == "loha":
            return f["hada_w1_a"].shape[0], f["hada_w1_b"].shape[1]
        w1, w2 = self._side(1, torch.float32), self._side(2, torch.float32)
        return w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1]

    def _side(self, index: int, dtype: torch.dtype) -> Tensor:
        f = self.factors
        whole = f.get(f"lokr_w{index}")
        if whole is not None:
            return whole.to(dtype)
        return f[f"lokr_w{index}_a"].to(dtype) @ f[f"lokr_w{index}_b"].to(dtype)

    def weight(self, dtype: torch.dtype) -> Tensor:
        """The delta weight (out, in) of a LoHa or LoKr, times the scale."""
        f = self.factors
        if self.kind == "loha":
            first = f["hada_w1_a"].to(dtype) @ f["hada_w1_b"].to(dtype)
            return first * (f["hada_w2_a"].to(dtype) @ f["hada_w2_b"].to(dtype)) * self.scale
        return torch.kron(self._side(1, dtype), self._side(2, dtype)) * self.scale

    def output(self, x: Tensor) -> Tensor:
        """What the module's output gains for input `x`."""
        if self.kind != "lora":
            return F.linear(x, self.weight(x.dtype))
        f = self.factors
        bias = f.get("lora_B.bias")
        low = F.linear(F.linear(x, f["lora_A"].to(x.dtype)), f["lora_B"].to(x.dtype))
        return (low if bias is None else low + bias.to(x.dtype)) * self.scale

    def to(self, device: torch.device) -> Delta:
        return Delta(self.kind, {name: t.to(device) for name, t in self.factors.items()}, self.scale)


NEEDED = {  # each kind's factors a module's delta is made of (LoKr: each side whole or split in two)
    "lora": (("lora_A",), ("lora_B",)),
    "loha": (("hada_w1_a",), ("hada_w1_b",), ("hada_w2_a",), ("hada_w2_b",)),
    "lokr": (("lokr_w1", "lokr_w1_a"), ("lokr_w2", "lokr_w2_a")),
}


def _metadata(path: Path) -> dict:
    """The peft config a diffusers-written file carries (`lora_adapter_metadata`, keys under `transformer.`)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        stored = (handle.metadata() or {}).get("lora_adapter_metadata")
    if not stored:
        return {}
    return {k.removeprefix(PREFIX): v for k, v in json.loads(stored).items()}


def _state(path: Path, spec) -> dict[str, Tensor]:
    """The file's tensors under peft names with the `transformer.` prefix: as they are, or as the family pipeline's
    `lora_state_dict` converts another tool's names (where diffusers knows them)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    if all(key.startswith(PREFIX) for key in state):
        return state
    loader = getattr(spec.pipeline_class(), "lora_state_dict", None)
    converted = {}
    if loader is not None:
        try:
            converted = loader(str(path))
        except (ValueError, KeyError, RuntimeError) as err:
            log.debug("%s: the family's LoRA loader did not convert it: %s", path, err)
    if isinstance(converted, tuple):
        converted = converted[0]
    if not converted or not any(key.startswith(PREFIX) for key in converted):
        first = sorted(state)[:3]
        raise UserError(
            f"validation_stack.loras: {path} holds no LoRA of the transformer that vt reads (keys such as {first}): "
            f"give a file vt exported (<run.dir>/lora/pytorch_lora_weights.safetensors) or one the {spec.family} "
            "pipeline's load_lora_weights converts"
        )
    return converted


def read_file(path: str | Path, spec, strength: float) -> dict[str, Delta]:
    """module name (the transformer's, as named_modules gives it) -> its Delta, from a LoRA file."""
    path = Path(path)
    state, settings = _state(path, spec), _metadata(path)
    parts: dict[str, dict[str, Tensor]] = {}
    alphas: dict[str, float] = {}
    skipped = []
    for key, tensor in state.items():
        if not key.startswith(PREFIX):
            skipped.append(key)  # a text encoder's: validation reads stage 1's conditions
            continue
        name = key.removeprefix(PREFIX)
        if name.endswith(".alpha"):
            alphas[name.removesuffix(".alpha")] = float(tensor)
            continue
        if not is_adapter(name):
            skipped.append(key)
            continue
        module = module_of(name)
        part = name[len(module) + 1 :].removesuffix(".weight")
        if part.startswith(MAGNITUDE):
            raise UserError(
                f"validation_stack.loras: {path} is a DoRA, whose magnitude rescales the whole adapted weight: a "
                "stacked render adds deltas only; stack a LoRA, LoHa or LoKr"
            )
        parts.setdefault(module, {})[part] = tensor
    if skipped:
        log.warning("validation_stack: %s: %d keys not stacked (e.g. %s)", path, len(skipped), skipped[0])
    if not parts:
        raise UserError(f"validation_stack.loras: {path} holds no adapter of the transformer")
    kind = kind_of(f"{module}.{part}" for module, factors in parts.items() for part in factors)
    rank = settings.get("r")
    alpha = settings.get("alpha" if kind != "lora" else "lora_alpha")
    out = {}
    for module, factors in parts.items():
        if kind == "lora" and module in alphas:  # another tool's alpha per module, over the rank it has
            scale = alphas[module] / factors["lora_A"].shape[0]
        elif rank and alpha is not None:
            scale = float(alpha) / float(rank)
        else:
            scale = 1.0  # no alpha anywhere: scale 1, as diffusers loads such a file
        missing = [alternatives[0] for alternatives in NEEDED[kind] if not any(a in factors for a in alternatives)]
        if missing:
            raise UserError(f"validation_stack.loras: {path} holds no {missing[0]} of {module!r}: not a whole {kind}")
        out[module] = Delta(kind, factors, scale * strength)
    return out


def module_names(model: nn.Module) -> dict[str, nn.Module]:
    """The model's modules by the names a LoRA file gives them (wrapper segments taken out)."""
    out = {}
    for name, module in model.named_modules():
        for segment in WRAPPERS:
            name = name.replace(segment, "")
        out.setdefault(name, module)
    return out


def check_targets(model: nn.Module, deltas: dict[str, Delta], path: str, staged: bool = False) -> int:
    """How many modules of `deltas` this model (or pipeline stage, `staged`) holds; a module it names that is missing
    (not under pipeline stages, whose other stages hold it) or of another shape is refused, naming the file."""
    modules = module_names(model)
    found = 0
    for name, delta in deltas.items():
        module = modules.get(name)
        if module is None:
            if staged:
                continue
            raise UserError(
                f"validation_stack.loras: {path} adapts {name!r}, which the transformer has no module of (a LoRA of "
                "another model?)"
            )
        shape = (getattr(module, "out_features", None), getattr(module, "in_features", None))
        if shape != tuple(delta.shape()):
            raise UserError(
                f"validation_stack.loras: {path} changes {name!r} as a {delta.shape()[0]} x {delta.shape()[1]} "
                f"linear layer; the transformer's is {shape[0]} x {shape[1]} (a LoRA of another model size?)"
            )
        found += 1
    return found


@contextlib.contextmanager
def stacked(model: nn.Module, files: list[dict[str, Delta]], device: torch.device) -> Iterator[None]:
    """`model` computes with every file's delta added inside the block (on `device` meanwhile), as it was after."""
    modules = module_names(model)
    handles = []
    per_module: dict[str, list[Delta]] = {}
    for deltas in files:
        for name, delta in deltas.items():
            if name in modules:
                per_module.setdefault(name, []).append(delta.to(device))

    def hook(deltas: list[Delta]):
        def add(module, args, output):
            for delta in deltas:
                output = output + delta.output(args[0]).to(output.dtype)
            return output

        return add

    try:
        for name, deltas in per_module.items():
            handles.append(modules[name].register_forward_hook(hook(deltas)))
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for handle in handles:
            handle.remove()
