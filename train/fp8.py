"""float8 where it saves memory or time: fp8 frozen base weights for LoRA, torchao fp8 training.

- `frozen_base.fp8` (LoRA): the frozen transformer is stored in float8 e4m3 (1 byte per
  weight, half of bf16) and each layer is upcast just for its own compute (train/frozen_storage.py:
  one process upcasts per matmul, skipping the layers the model class marks as precision-sensitive:
  norms, embeddings, patch projections; under FSDP2 FSDP2's MixedPrecisionPolicy upcasts them when it
  all-gathers a block). It is applied before the adapters are added, so the LoRA weights and their
  optimizer state stay fp32. A base from one fp8-scaled file (ComfyUI's) keeps the file's own float8 values
  and per-tensor scales instead of a plain cast (frozen_storage.py).
- `fp8_training.recipe` (full fine-tuning): torchao's float8 linear layers with the tensorwise or
  rowwise recipe, on the layers torchao's size filter keeps (small matmuls stay bf16); tensorwise
  under FSDP2 all-gathers in float8. It needs float8 matmuls: a CUDA GPU of sm89+ (Ada, Hopper, later).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from vt.shared.log import get_logger
from vt.train.frozen_storage import store_frozen, weight_bytes

__all__ = [
    "FP8_STORAGE",
    "fp8_training_support",
    "store_base_fp8",
    "apply_fp8_training",
    "after_optimizer_step",
    "weight_bytes",
]
log = get_logger("vt.train.fp8")
FP8_STORAGE = torch.float8_e4m3fn
FP8_RECIPES = ("tensorwise", "rowwise")


def store_base_fp8(model: nn.Module, compute_dtype: torch.dtype, sharded: bool) -> int:
    """`frozen_base.fp8`: the frozen weights stored in float8 e4m3 (train/frozen_storage.py)."""
    return store_frozen(model, FP8_STORAGE, compute_dtype, sharded)


def fp8_training_support(device: torch.device) -> str | None:
    """Why float8 training cannot run on `device` here, or None when it can."""
    if device.type != "cuda":
        return f"float8 training needs a CUDA GPU of sm89+ (Ada, Hopper or later); this run is on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (
            f"float8 training needs a CUDA GPU of sm89+ (Ada, Hopper or later); "
            f"{torch.cuda.get_device_name(device)} is sm{capability[0]}{capability[1]}"
        )
    if importlib.util.find_spec("torchao") is None:
        return "float8 training needs torchao: pip install 'vt[fp8]' (or pip install torchao)"
    return None


def apply_fp8_training(model: nn.Module, recipe: str, fsdp: bool, module_filter=None) -> list[str]:
    """Swap the linear layers torchao's filter picks for float8 ones (in place); returns their names.

    `module_filter(module, name) -> bool` replaces torchao's size filter (benchmarks of tiny shapes)."""
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp and recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # the tensorwise recipe's defaults
    keep = module_filter or _auto_filter_for_recipe(recipe, filter_fqns=[])
    chosen = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and keep(module, name)]
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    log.info(
        "fp8 training (%s%s): %d of %d linear layers in float8, e.g. %s",
        recipe,
        ", float8 all-gather" if config.enable_fsdp_float8_all_gather else "",
        len(chosen),
        linears,
        ", ".join(chosen[:4]) or "none",
    )
    return chosen


def after_optimizer_step(model: nn.Module, recipe: str, fsdp: bool) -> None:
    """Tensorwise float8 all-gather: precompute the next step's scales in one collective."""
    if recipe == "tensorwise" and fsdp:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
