"""Ulysses inside one attention module: the hooks that move its queries, keys and values between "my tokens,
all heads" and "all tokens, my heads" (train/parallel/cp.py applies them per the family's ContextParallelPlan).

Three kinds of attention:
- `make_ulysses`: self-attention over the split tokens, or joint attention over [split tokens, a stream every
  rank holds whole] (e.g. text): the split stream's projections switch to heads by all-to-all, the whole
  stream's keep this rank's heads (no communication); after the core the split stream switches back and the
  whole stream's output gathers every rank's heads;
- `make_whole_queries`: queries from a whole stream (e.g. audio), keys and values from the split tokens: the
  queries keep this rank's heads, the keys and values switch to heads, the output gathers every rank's heads;
- `make_split_queries`: queries from the split tokens, keys and values from a whole stream: nothing moves (as a
  cross-attention), but the queries' rotary table, built for the whole sequence, is cut to this rank's tokens.
Gradients keep cp.py's convention: summed over the cp ranks they are P x the single-process ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vt.shared.errors import UserError
from vt.shared.models.plans import ContextParallelPlan, CrossStreamPlan
from vt.train.parallel.ulysses import gather_heads, heads_to_sequence, local_heads, sequence_to_heads, split_sequence


def _local_heads_hook(group):
    return lambda module, args, output: local_heads(output, group)


def _to_heads_hook(group, layout: dict):
    return lambda module, args, output: sequence_to_heads(output, group, layout["sizes"])


def _gather_heads_pre_hook(group):
    # prepend (at registration): runs before a row-wise TP layer's own input hook, on the plain local tensor
    return lambda module, args: (gather_heads(args[0], group), *args[1:])


def _local_head_count(attn: nn.Module, plan: ContextParallelPlan, size: int, where: str) -> None:
    heads = getattr(attn, plan.heads_attribute)
    if heads % size:
        raise UserError(
            f"{where} has {heads} attention heads on this rank, which do not divide over "
            f"parallel.cp = {size}; Ulysses needs tp x cp to divide the head count"
        )
    setattr(attn, plan.heads_attribute, heads // size)


def make_ulysses(
    attn: nn.Module, plan: ContextParallelPlan, group: dist.ProcessGroup, where: str, layout: dict
) -> None:
    """`layout["sizes"]`: every rank's count of split tokens in this forward (cp.py sets it where it splits)."""
    _local_head_count(attn, plan, dist.get_world_size(group), where)
    held = {"split": 0, "whole": 0}  # this call's token counts: split (video) and whole (joint text)
    joint = bool(plan.replicated_to_heads)
    if joint:
        attn.register_forward_pre_hook(_count_tokens(held), with_kwargs=True)

    def to_heads(module, args, output):
        if held["whole"] and output.shape[1] == held["split"] + held["whole"]:  # [video, text] projected together
            split, whole = output.split([held["split"], held["whole"]], dim=1)
            return torch.cat([sequence_to_heads(split, group, layout["sizes"]), local_heads(whole, group)], dim=1)
        return sequence_to_heads(output, group, layout["sizes"])

    found = [module for name in plan.sequence_to_heads if (module := _optional(attn, name)) is not None]
    if not found:
        raise ValueError(f"{where} has none of {plan.sequence_to_heads}; fix the family's cp_plan()")
    for module in found:  # optional ones (e.g. gate logits per head) are skipped where an attention lacks them
        module.register_forward_hook(to_heads)
    for name in plan.replicated_to_heads:
        if (module := _optional(attn, name)) is not None:
            module.register_forward_hook(_local_heads_hook(group))
    # prepend: the all-to-all must see this rank's plain local tensor. When the output projection is
    # itself a row-wise TP Linear (full fine-tuning; with LoRA the style sits on its base_layer), its
    # own input pre-hook, registered earlier by apply_tp, wraps the input as a DTensor (Shard(-1) on
    # the tp mesh); run the sequence switch before that, as it would run with tp = 1.
    to_sequence = _optional(attn, plan.heads_to_sequence)
    if to_sequence is not None:
        to_sequence.register_forward_pre_hook(
            lambda module, args: (heads_to_sequence(args[0], group, layout["sizes"]), *args[1:]), prepend=True
        )
    gather_from = _optional(attn, plan.replicated_from_heads) if joint else None
    if gather_from is not None:
        gather_from.register_forward_pre_hook(_gather_heads_pre_hook(group), prepend=True)
    if to_sequence is None or (joint and gather_from is None):  # a pre-only attention returns (video, text)

        def switch_back(module, args, output):
            video, text = output if isinstance(output, tuple) else (output, None)
            video = heads_to_sequence(video, group, layout["sizes"]) if to_sequence is None else video
            text = gather_heads(text, group) if joint and gather_from is None and text is not None else text
            return (video, text) if isinstance(output, tuple) else video

        attn.register_forward_hook(switch_back)


def _count_tokens(held: dict):
    """A pre-hook on a joint attention noting its split (hidden_states) and whole (encoder_hidden_states) lengths."""

    def count(module, args, kwargs):
        video = kwargs.get("hidden_states", args[0] if args else None)
        text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
        held["split"] = video.shape[1]
        held["whole"] = text.shape[1] if isinstance(text, Tensor) else 0

    return count


def _optional(module: nn.Module, name: str | None) -> nn.Module | None:
    """module.name, or None where the module has no such (or a None) submodule."""
    if not name:
        return None
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def make_whole_queries(
    attn: nn.Module, plan: ContextParallelPlan, group: dist.ProcessGroup, where: str, layout: dict
) -> None:
    """Queries from a whole stream, keys and values from the split tokens (e.g. video-to-audio attention)."""
    cross = plan.cross_stream
    _local_head_count(attn, plan, dist.get_world_size(group), where)
    hooks = ((cross.whole_queries, _local_heads_hook(group)), (cross.split_keys, _to_heads_hook(group, layout)))
    for names, hook in hooks:
        for name in names:
            if (module := _optional(attn, name)) is not None:
                module.register_forward_hook(hook)
    attn.get_submodule(plan.heads_to_sequence).register_forward_pre_hook(_gather_heads_pre_hook(group), prepend=True)
    heads = cross.rope_dims[1]

    def rope_heads(module, args, kwargs):  # both tables: this rank's heads (the keys' over all tokens)
        for name in cross.rope_arguments:
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(local_heads(t.movedim(heads, -1), group).movedim(-1, heads) for t in kwargs[name])
        return args, kwargs

    attn.register_forward_pre_hook(rope_heads, with_kwargs=True)


def make_split_queries(attn: nn.Module, cross: CrossStreamPlan, group: dist.ProcessGroup) -> None:
    """Queries from the split tokens, keys and values from a whole stream (e.g. audio-to-video attention)."""
    query_rope, tokens = cross.rope_arguments[0], cross.rope_dims[0]

    def rope_tokens(module, args, kwargs):
        if kwargs.get(query_rope) is not None:
            kwargs[query_rope] = tuple(
                split_sequence(t, tokens % t.ndim, group, uneven=True) for t in kwargs[query_rope]
            )
        return args, kwargs

    attn.register_forward_pre_hook(rope_tokens, with_kwargs=True)
