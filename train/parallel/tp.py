"""Tensor parallel for a video transformer, driven by its Model Spec's `tp_plan()`.

Megatron-style, with DTensor: in each block the q/k/v projections and the FFN's first layer are
split column-wise (each rank computes whole heads / a slice of the hidden FFN units), the attention
output projection and the FFN's second layer row-wise (each rank multiplies its slice and the
results are summed over the tp group). Everything else stays replicated. Each rank then runs
attention on its local heads, so the attention modules get the local head count; query/key RMSNorms
that span all heads become `ShardedRMSNorm` (sum of squares all-reduced over tp); rotary tables laid
out over all heads' channels (the plan's `channel_rope`) are cut to this rank's channels.

LoRA: add the adapters BEFORE `apply_tp` (the trainer's order is build on meta -> LoRA -> TP -> CP ->
AC -> compile -> FSDP -> fill -> DDP, train/model_build.py). A peft LoRA layer is split consistently with its base layer:
- column-wise base: lora_A stays replicated (it reads the replicated input), lora_B is split
  column-wise, so the LoRA update lands on the same output channels as the base;
- row-wise base: lora_A is split row-wise (it reads the sharded input; its small rank-r output is
  summed over tp), lora_B stays replicated.
Adding LoRA after TP is not supported: peft would size the adapter from the full layer. Only LoRA's two
factors split so: the other adapter kinds (adapter.kind: DoRA's magnitude normalises whole rows, LoHa's and
LoKr's products mix the factors' rows and columns) are refused with tp > 1.

Gradients: tp ranks compute the same loss. Split parameters (DTensor) get their own shard of the
true gradient; replicated ones get the full gradient on every tp rank (DTensor's input conversion
all-reduces the input gradient of each column-wise layer), so no gradient sync over tp is needed.
A replicated parameter used on the local heads only (a per-head norm's weight shared by every head)
would get just its heads' share, so `apply_tp` refuses one that trains.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from vt.shared.adapters import kind_of
from vt.shared.errors import UserError
from vt.shared.models.plans import TensorParallelPlan
from vt.shared.models.spec import ModelSpec
from vt.train.parallel.dims import layout_plan
from vt.train.parallel.dist_norm import ShardedRMSNorm

log = logging.getLogger(__name__)

APPLIED_ATTR = "_vt_parallel"  # list of strategies applied to a transformer, in order (checked by apply_cp)


def apply_tp(transformer: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh) -> None:
    """Split `transformer` in place over the 1-D `tp_mesh`, following `spec.tp_plan()`."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs the 1-D tp mesh (world_mesh['tp']), got a {tp_mesh.ndim}-D mesh")
    applied = getattr(transformer, APPLIED_ATTR, [])
    if applied:
        raise RuntimeError(
            f"apply_tp must come first (order: TP -> CP -> AC -> compile -> FSDP/DDP); "
            f"{applied} was already applied to this transformer"
        )
    if tp_mesh.size() == 1:
        return
    kind = kind_of(name for name, _ in transformer.named_parameters())
    if kind != "lora":
        raise UserError(
            f"adapter.kind = {kind!r} with parallel.tp = {tp_mesh.size()}: tensor parallel splits only "
            'LoRA\'s two factors; set adapter.kind = "lora", or parallel.tp = 1 (FSDP2 shards any '
            "adapter: parallel.dp_shard)"
        )
    plan = layout_plan(spec, "tp")
    for where, block in spec.named_blocks(transformer):
        has = _present(block, plan)
        _check_block(block, plan, tp_mesh.size(), where, has)
        styles: dict[str, ParallelStyle] = {}
        for name in filter(has, plan.colwise):
            styles.update(_linear_styles(block, name, column=True))
        for name in filter(has, plan.rowwise):
            styles.update(_linear_styles(block, name, column=False))
        parallelize_module(block, tp_mesh, styles)
        for name in filter(has, plan.attention):
            attn = block.get_submodule(name)
            setattr(attn, plan.heads_attribute, getattr(attn, plan.heads_attribute) // tp_mesh.size())
        for name in filter(has, plan.head_norms):
            block.set_submodule(name, ShardedRMSNorm.from_rmsnorm(block.get_submodule(name), tp_mesh))
    if plan.channel_rope:
        slice_rope_channels(transformer.get_submodule(plan.channel_rope), tp_mesh)
    for rope, dim in plan.rope_heads.items():
        slice_rope_channels(transformer.get_submodule(rope), tp_mesh, dim)
    setattr(transformer, APPLIED_ATTR, ["tp"])
    log.info("tensor parallel over %d ranks: %d blocks split", tp_mesh.size(), len(spec.blocks(transformer)))


def _present(block: nn.Module, plan: TensorParallelPlan):
    """A filter of the plan's names: False for those under an `optional` module this block lacks."""
    absent = []
    for name in plan.optional:
        try:
            block.get_submodule(name)
        except AttributeError:
            absent.append(name)
    return lambda name: not any(name == a or name.startswith(f"{a}.") for a in absent)


def _check_block(block: nn.Module, plan: TensorParallelPlan, size: int, where: str, has) -> None:
    for name in filter(has, plan.attention):
        attn = block.get_submodule(name)
        heads = getattr(attn, plan.heads_attribute)
        if heads % size:
            raise UserError(
                f"{where}.{name} has {heads} attention heads, which do not divide over "
                f"parallel.tp = {size}; choose a tp size that divides {heads}"
            )
        if getattr(attn, "fused_projections", False):
            raise ValueError(f"{where}.{name} has fused q/k/v projections; unfuse them before tensor parallel")
        if getattr(attn, "add_k_proj", None) is not None and not {f"{name}.add_k_proj", f"{name}.add_v_proj"} <= set(
            plan.colwise
        ):
            raise UserError(
                f"{where}.{name} has added key/value projections (image conditioning), "
                f"which the family's TP plan does not split; use parallel.tp = 1"
            )
        split = tuple(f"{layer}." for layer in (*plan.colwise, *plan.rowwise, *plan.head_norms))
        for param_name, param in attn.named_parameters():
            if param.requires_grad and not f"{name}.{param_name}".startswith(split):
                raise UserError(
                    f"{where}.{name}.{param_name} is shared by every head (e.g. a per-head query/key "
                    f"norm) and trains: under tensor parallel each rank would see only its own heads' "
                    f'gradient. Train LoRA (train.mode = "lora"), or set parallel.tp = 1'
                )


def _linear_styles(block: nn.Module, name: str, column: bool) -> dict[str, ParallelStyle]:
    """ParallelStyles for one planned layer: the Linear itself, or a peft LoRA layer's parts."""
    module = block.get_submodule(name)
    split = ColwiseParallel if column else RowwiseParallel
    if isinstance(module, nn.Linear):
        return {name: _local_split(split())}
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        if getattr(module, "lora_variant", None) or any(getattr(module, "use_dora", {}).values()):
            raise UserError(
                f"{name}: LoRA variants such as DoRA are not supported with tensor parallel; "
                f"use plain LoRA or parallel.tp = 1"
            )
        if not isinstance(module.base_layer, nn.Linear):
            raise TypeError(f"{name}: the LoRA layer wraps {type(module.base_layer).__name__}, not a Linear")
        styles: dict[str, ParallelStyle] = {f"{name}.base_layer": _local_split(split())}
        for adapter in module.lora_A:
            # The LoRA factor that touches the split side is split the same way; the other stays whole.
            if column:
                styles[f"{name}.lora_B.{adapter}"] = _local_split(ColwiseParallel())
            else:
                styles[f"{name}.lora_A.{adapter}"] = _local_split(RowwiseParallel())
        return styles
    raise TypeError(
        f"the TP plan names {name!r}, a {type(module).__name__}; expected a Linear or a peft LoRA "
        f"layer around one. Fix the family's tp_plan()"
    )


def _local_split(style: ParallelStyle) -> ParallelStyle:
    """Every rank holds the same values (checkpoint tensors, adapters keyed by name; or nothing yet, on
    the meta device, filled later by block): each rank cuts its own shard, no scatter from rank 0."""
    style.src_data_rank = None
    return style


def slice_rope_channels(rope: nn.Module, mesh: DeviceMesh, dim: int = -1) -> None:
    """Keep this rank's chunk of `dim` (the channels, or the heads) of every tensor `rope` returns (rank order,
    as the heads)."""
    size, rank = mesh.size(), mesh.get_local_rank()

    def keep_local_channels(module, args, output):
        def cut(t):
            if t.shape[dim] % size:
                raise UserError(f"rotary tables of {t.shape[dim]} channels or heads do not split over {size} ranks")
            width = t.shape[dim] // size
            return t.narrow(dim, rank * width, width)

        return tuple(cut(t) for t in output) if isinstance(output, (tuple, list)) else cut(output)

    rope.register_forward_hook(keep_local_channels)
