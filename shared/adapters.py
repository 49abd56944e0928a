"""The adapter kinds a run trains (`adapter.kind`), in one place: their peft configs, their weights' names,
how each starts, and what names their files use.

    lora  LoraConfig                    <module>.lora_A.weight (r, in), .lora_B.weight (out, r)
    dora  LoraConfig(use_dora=True)     LoRA's two factors and <module>.lora_magnitude_vector (out,)
    loha  LoHaConfig                    <module>.hada_w1_a (out, r), .hada_w1_b (r, in), .hada_w2_a, .hada_w2_b
    lokr  LoKrConfig                    <module>.lokr_w1 (or .lokr_w1_a/_b), .lokr_w2 (or .lokr_w2_a/_b)

(peft's saved names, as `get_peft_model_state_dict` gives them; in the model each parameter also carries the
adapter's name: `lora_A.default.weight`, `hada_w1_a.default`.) Every kind targets the same modules with the
same rank and alpha, and starts as peft starts it: the delta is zero because one factor is (lora_B, hada_w2_b,
lokr_w1 or lokr_w1_a), the others Kaiming-uniform (a = sqrt 5), drawn here from a generator keyed by the
weight's name so that every layout and every rank draws the same values. DoRA's magnitude starts as the base
weight's row norms, which only the filled base weight gives (train/model_build.py fills it after the base).
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any

import torch

from vt.shared.runtime import keyed_generator

KINDS: tuple[str, ...] = ("lora", "dora", "loha", "lokr")  # adapter.kind's values
MAGNITUDE = "lora_magnitude_vector"
# Each kind's weights, by the part of the name that follows the module (peft's `adapter_layer_names`).
PARTS = {
    "lora": ("lora_A", "lora_B"),
    "dora": ("lora_A", "lora_B", MAGNITUDE),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"),
}
# The factor that starts at zero, so that the adapted model starts as the base (peft's default init).
ZERO_FACTORS = ("lora_B", "hada_w2_b", "lokr_w1", "lokr_w1_a")
_PART = re.compile(
    r"\.(lora_A|lora_B|lora_magnitude_vector|hada_w[12]_[ab]|hada_t[12]|lokr_w[12](_[ab])?|lokr_t2)"
    r"(\.|$)"
)


def part_of(name: str) -> str | None:
    """The adapter weight `name` names (`lora_A`, `hada_w2_b`, `lora_magnitude_vector` ...), or None for any
    other parameter (a base weight, `base_layer.weight`)."""
    match = _PART.search(name)
    return match[1] if match else None


def is_adapter(name: str) -> bool:
    """Whether `name` (a parameter's name in the model or a key of an adapter file) is an adapter weight, of
    any kind."""
    return part_of(name) is not None


def module_of(name: str) -> str:
    """The adapted module of an adapter weight: `blocks.0.attn1.to_q` for `blocks.0.attn1.to_q.hada_w1_a`."""
    match = _PART.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not an adapter weight")
    return name[: match.start()]


def kind_of(names) -> str:
    """The kind of adapter whose weights `names` (a state dict or an iterable of names) are; "lora" also when
    none is an adapter's."""
    parts = {part_of(name) for name in names} - {None}
    for kind in ("lokr", "loha", "dora"):
        if parts & set(PARTS[kind]) - set(PARTS["lora"]):
            return kind
    return "lora"


def saved_name(name: str, adapter: str = "default") -> str:
    """A model parameter's name as peft's `get_peft_model_state_dict` saves it: without the adapter's name
    (`to_q.lora_A.default.weight` -> `to_q.lora_A.weight`, `to_q.hada_w1_a.default` -> `to_q.hada_w1_a`) and
    DoRA's magnitude without `.weight` (`to_q.lora_magnitude_vector`)."""
    name = name.replace(f".{adapter}.", ".").removesuffix(f".{adapter}")
    return name.removesuffix(".weight") if name.endswith(f".{MAGNITUDE}.weight") else name


def metadata(kind: str, rank: int, alpha: float, targets, excluded: str | None = None) -> dict[str, Any]:
    """The keyword arguments of the kind's peft config: what an exported file's metadata carries, so a loader
    rebuilds the same adapters and scale (`peft_config` takes them back). LoRA's are {r, lora_alpha,
    target_modules}, as before; the other kinds add what names them (`use_dora`, `peft_type`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown adapter kind {kind!r}; one of {KINDS}")
    out: dict[str, Any] = {"r": rank, "target_modules": targets}
    if kind in ("lora", "dora"):
        out["lora_alpha"] = alpha
    else:
        out.update(alpha=alpha, peft_type=kind.upper())
    if kind == "dora":
        out["use_dora"] = True
    if excluded:
        out["exclude_modules"] = excluded
    return out


def peft_config(settings: dict[str, Any]):
    """The peft config of `metadata(...)`'s settings: LoraConfig (use_dora for DoRA), LoHaConfig or LoKrConfig,
    with peft's default start."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    settings = dict(settings)
    peft_type = settings.pop("peft_type", "LORA")
    if peft_type == "LOHA":
        return LoHaConfig(**settings, init_weights=True)
    if peft_type == "LOKR":
        return LoKrConfig(**settings, init_weights=True)
    return LoraConfig(**settings, init_lora_weights=True)


def initial(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """peft's default start for the adapter weight `name` (a model parameter's plain name): zero for the zero
    factor (and DoRA's magnitude, until the base weight fills it), Kaiming-uniform (a = sqrt 5) for the other
    factors, drawn from a generator keyed by (seed, name)."""
    out = torch.zeros(shape)
    part = part_of(name)
    if part is None:
        raise ValueError(f"{name!r} is not an adapter weight")
    if part not in ZERO_FACTORS and part != MAGNITUDE:
        torch.nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=keyed_generator("lora", seed, name))
    return out


def row_norms(weight: torch.Tensor) -> torch.Tensor:
    """DoRA's starting magnitude for a base weight (out, in): its rows' L2 norms, in float32 (peft's
    `DoraLinearLayer.update_layer` with lora_B zero)."""
    return torch.linalg.norm(weight.float(), dim=1)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Every peft adapter layer of `model` (LoRA, DoRA, LoHa, LoKr: `adapter.kind`) computes its base layer alone,
    then is switched back on: the frozen base, with no second copy (guided targets, validation's base renders).
    Only peft's `disable_adapters` flag changes: unlike its `enable_adapters`, no requires_grad flag is touched (FSDP2
    copies those into its unsharded parameters at their first all-gather). Every rank of a sharded model sets it
    alike, so the base's forwards stay in step."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    if not layers:
        raise ValueError("the frozen base needs adapters: the transformer has no adapters to switch off")
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
        if not layer.disable_adapters:  # a peft that keeps the flag elsewhere
            raise RuntimeError(
                f"{type(layer).__name__}.disable_adapters did not follow _disable_adapters: this peft "
                "version switches adapters off another way"
            )
    try:
        yield
    finally:
        for layer, flag in zip(layers, before):
            layer._disable_adapters = flag
