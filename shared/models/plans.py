"""How tensor and context parallel split a family's transformer: the plans a family declares (its layout role;
`tp_plan()` / `cp_plan()` return None where the family has none, and raise `Unplanned` where one setting of it
has none)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vt.shared.errors import UserError


class Unplanned(UserError):
    """A family that has a plan lacks it under this setting (the message says why and what to set)."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallel splits one transformer block; names are relative to a block.

    Column-wise layers split their output features in rank order (for q/k/v: whole heads per rank),
    row-wise layers split their input features and sum their outputs over the tp group. The
    attention modules then run on their local heads, and RMSNorms over all heads' channels
    (`head_norms`) sum their squares over the tp group so they still match one process.
    """

    colwise: tuple[str, ...]  # e.g. "attn1.to_q", "ff.net.0.proj"
    rowwise: tuple[str, ...]  # e.g. "attn1.to_out.0", "ff.net.2"
    attention: tuple[str, ...]  # attention modules whose `heads` becomes the local head count
    head_norms: tuple[str, ...] = ()  # torch.nn.RMSNorm over all heads' channels (query/key norms)
    # Transformer submodule returning rotary (cos, sin) laid out over all heads' channels on the last
    # dim (LTX-Video); each rank keeps its channels. None when the rotary tables span one head (Wan).
    channel_rope: str | None = None
    heads_attribute: str = "heads"  # the attention modules' head count, which becomes the local one
    optional: tuple[str, ...] = ()  # modules some blocks lack (e.g. a cross-attention): names under them skipped there
    rope_heads: dict[str, int] = field(default_factory=dict)  # as ContextParallelPlan's: tables laid out by head


@dataclass(frozen=True)
class CrossStreamPlan:
    """Attentions between the split tokens and a stream every cp rank holds whole (LTX-2's audio); names of
    attentions relative to a block, of projections relative to an attention."""

    queries_whole: tuple[str, ...]  # queries from the whole stream, keys/values from the split tokens
    queries_split: tuple[str, ...]  # queries from the split tokens, keys/values from the whole stream
    whole_queries: tuple[str, ...] = ("norm_q", "to_gate_logits")  # the whole stream's side: this rank's heads
    split_keys: tuple[str, ...] = ("norm_k", "to_v")  # the split side: switched to all tokens, this rank's heads
    rope_arguments: tuple[str, str] = ("query_rotary_emb", "key_rotary_emb")  # the attentions' rotary tables
    rope_dims: tuple[int, int] = (-2, -1)  # their (tokens, heads) dims; heads -1: over all heads' channels


@dataclass(frozen=True)
class ContextParallelPlan:
    """How context parallel splits the token sequence (Ulysses); names are relative to the transformer.

    The inputs named in `split_inputs` are cut to this rank's chunk along their sequence dim (a
    tensor that has no such dim, or size 1 there, such as a per-sample timestep, stays whole); the
    output of `gather_output` is gathered back along dim 1. Inside each block's self-attention,
    the outputs of `sequence_to_heads` switch from "my tokens, all heads" to "all tokens, my heads"
    and the input of `heads_to_sequence` switches back. Cross-attention keys and values come from
    the text, which is not split: its queries stay on the local tokens with all heads.

    Joint attention (text tokens, held whole by every rank, attend together with the split video tokens):
    the text's projections (`replicated_to_heads`) keep this rank's heads' channels, and the text's
    attention output is gathered over heads at the input of `replicated_from_heads`. Where a processor
    joins [video, text] before projecting, a `sequence_to_heads` output holds both (video first); an
    attention without `heads_to_sequence` / `replicated_from_heads` (a pre-only one) has its returned
    (video, text) pair switched back instead. Names an attention lacks are skipped.
    """

    split_inputs: dict[str, dict[str, int]]  # module ("" = the transformer) -> {argument name: sequence dim}
    gather_output: str  # module whose output (B, S/P, C) is gathered to (B, S, C)
    self_attention: tuple[str, ...]  # relative to a block
    sequence_to_heads: tuple[str, ...] = ("norm_q", "norm_k", "to_v")  # relative to an attention module
    heads_to_sequence: str = "to_out.0"
    replicated_to_heads: tuple[str, ...] = ()  # the whole (text) stream's q/k/v projections in joint attention
    replicated_from_heads: str | None = None  # the whole stream's output projection
    # transformer submodules returning rotary tables laid out by head -> the dim holding the heads (or all heads'
    # channels): each rank keeps its own (LTX-Video's tables over all heads' channels: -1; Mochi's (tokens, heads,
    # D/2): -2; LTX-2's split tables (B, heads, tokens, D/2): -3)
    rope_heads: dict[str, int] = field(default_factory=dict)
    block_lists: tuple[str, ...] = ()  # the block lists whose `self_attention` sees the split tokens (empty: all)
    heads_attribute: str = "heads"  # the attention modules' head count, which becomes the local one
    cross_stream: CrossStreamPlan | None = None
    uneven: bool = False  # a token count cp does not divide splits into chunks one token apart (else an error)
