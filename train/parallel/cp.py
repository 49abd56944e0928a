"""Context parallel (Ulysses) for a video transformer, driven by its Model Spec's `cp_plan()`.

After `apply_cp`, the transformer still takes the FULL inputs on every cp rank (ranks of one cp
group get identical samples, sigmas and noise) and returns the FULL output; inside, each rank
works on a contiguous 1/P of the token sequence:
- the inputs the plan names (packed tokens, per-token timesteps) are cut to this rank's chunk
  where the plan says (at the transformer's input for a model fed packed tokens; where the first
  block receives them for one that patchifies inside its forward);
- in each self-attention, queries, keys (after their norms) and values move from "my tokens, all
  heads" to "all tokens, my heads" with one all-to-all each, attention runs on full sequences for
  the local heads, and one all-to-all moves the result back before the output projection
  (DeepSpeed-Ulysses). Rotary tables are computed for the full sequence by the model already;
  where they are laid out by head each rank keeps its heads' (`rope_heads`). Joint attention with a
  stream every rank holds whole (text, audio) is in ulysses_attention.py;
- cross-attention needs no communication: its keys and values come from the text (not split);
- the output of the last projection is gathered back to the full sequence.
A plan marked `uneven` (a length that changes per sample) splits into chunks one token apart.
Ring attention (which needs an attention kernel that returns its log-sum-exp) is not used: on CPU
torch's ring attention fails in backward, and Ulysses covers head counts that divide tp x cp.

Order: after TP (whose head counts and norms this builds on), before AC, compile and FSDP/DDP.

Gradients: after backward each cp rank holds P x the gradient through its own tokens (see
`gather_sequence`; a stream held whole gets gradients that sum to P x its own over the cp ranks), so
AVERAGING gradients over the cp group gives the single-process gradient.
FSDP2 or DDP over a mesh that includes cp (e.g. dp_shard x cp flattened) does that; without one,
call `average_gradients(transformer, cp_mesh)` after backward.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vt.shared.models.spec import ModelSpec
from vt.train.parallel.dims import layout_plan
from vt.train.parallel.tp import APPLIED_ATTR, slice_rope_channels
from vt.train.parallel.ulysses import chunk_sizes, gather_sequence, split_sequence
from vt.train.parallel.ulysses_attention import make_split_queries, make_ulysses, make_whole_queries

log = logging.getLogger(__name__)


def apply_cp(transformer: nn.Module, spec: ModelSpec, cp_mesh: DeviceMesh) -> None:
    """Make `transformer` split its token sequence over the 1-D `cp_mesh` (in place), per `spec.cp_plan()`."""
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp needs the 1-D cp mesh (world_mesh['cp']), got a {cp_mesh.ndim}-D mesh")
    applied = getattr(transformer, APPLIED_ATTR, [])
    if "cp" in applied:
        raise RuntimeError("apply_cp was already applied to this transformer")
    if cp_mesh.size() == 1:
        return
    plan = layout_plan(spec, "cp")
    group, size = cp_mesh.get_group(), cp_mesh.size()
    layout = {"sizes": None}  # every rank's token count in the current forward, set where the tokens are split
    for path, arguments in plan.split_inputs.items():
        module = transformer.get_submodule(path) if path else transformer
        module.register_forward_pre_hook(
            _split_arguments(module, arguments, group, layout, plan.uneven), with_kwargs=True
        )
    for where, block in spec.named_blocks(transformer):
        if plan.block_lists and where.rpartition(".")[0] not in plan.block_lists:
            continue  # e.g. text-only blocks, which every rank runs whole
        for name in plan.self_attention:
            make_ulysses(block.get_submodule(name), plan, group, f"{where}.{name}", layout)
        if plan.cross_stream is not None:
            for name in plan.cross_stream.queries_whole:
                make_whole_queries(block.get_submodule(name), plan, group, f"{where}.{name}", layout)
            for name in plan.cross_stream.queries_split:
                make_split_queries(block.get_submodule(name), plan.cross_stream, group)
    for rope, dim in plan.rope_heads.items():
        slice_rope_channels(transformer.get_submodule(rope), cp_mesh, dim)
    transformer.get_submodule(plan.gather_output).register_forward_hook(
        lambda module, args, output: gather_sequence(output, 1, group, layout["sizes"])
    )
    setattr(transformer, APPLIED_ATTR, applied + ["cp"])
    log.info("context parallel (Ulysses) over %d ranks", size)


def _split_arguments(
    module: nn.Module, arguments: dict[str, int], group: dist.ProcessGroup, layout: dict, uneven: bool
):
    """A forward pre-hook cutting the named arguments (given by keyword or position) to this rank's chunk."""
    names = list(inspect.signature(module.forward).parameters)
    missing = [name for name in arguments if name not in names]
    if missing:
        raise ValueError(
            f"the CP plan splits {missing} of {type(module).__name__}, whose forward takes {names}; "
            f"fix the family's cp_plan()"
        )
    positions = {name: names.index(name) for name in arguments}

    def split(module, args, kwargs):
        args = list(args)
        for name, dim in arguments.items():
            if name in kwargs:
                kwargs[name] = _split_if_sequence(kwargs[name], dim, group, layout, uneven)
            elif positions[name] < len(args):
                args[positions[name]] = _split_if_sequence(args[positions[name]], dim, group, layout, uneven)
        return tuple(args), kwargs

    return split


def _split_if_sequence(value, dim: int, group: dist.ProcessGroup, layout: dict, uneven: bool):
    """Split a tensor along `dim`; one without that dim or of size 1 there (a per-sample timestep) stays whole."""
    if not isinstance(value, Tensor) or value.ndim <= dim or value.shape[dim] == 1:
        return value
    layout["sizes"] = chunk_sizes(value.shape[dim], dist.get_world_size(group))
    return split_sequence(value, dim, group, uneven)


def average_gradients(module: nn.Module, mesh: DeviceMesh) -> None:
    """Average every parameter's gradient over `mesh` in place (for cp when no FSDP/DDP mesh covers it)."""
    group, size = mesh.get_group(), mesh.size()
    with torch.no_grad():
        for param in module.parameters():
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=group)  # gloo has no AVG: sum, then divide
            grad.div_(size)
