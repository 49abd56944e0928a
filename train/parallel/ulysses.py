"""Differentiable collectives that move a token sequence between layouts, Ulysses style.

Context parallel keeps each rank on a contiguous chunk of the token sequence. Attention needs every
token, so around the attention core the layout switches: an all-to-all turns "my tokens, all heads'
channels" (B, S/P, C) into "all tokens, my heads' channels" (B, S, C/P) and back afterwards. Heads
are independent in attention, so the core then runs unchanged on full sequences for its local heads.

All collectives here are torch's functional collectives (`_functional_collectives`), which work
eagerly over gloo and NCCL and also trace under torch.compile (torch.distributed.nn.functional
refuses to run under compile). Their gradients:
- `sequence_to_heads` / `heads_to_sequence`: the reverse all-to-all;
- `gather_sequence`: each rank keeps its own slice of the output gradient, times the group size
  (see its docstring for why);
- `all_reduce_sum`: the gradient is all-reduced too (each rank's input reaches every rank's output);
- `local_heads` / `gather_heads` (a stream every cp rank holds whole, e.g. joint attention's text): a
  slice of this rank's heads' channels (gradient zero elsewhere), and an all-gather of every rank's heads
  whose gradient is reduce-scattered (summed over the ranks that used each rank's heads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from vt.shared.errors import UserError


def _wait(tensor: Tensor) -> Tensor:
    """Eager functional collectives return a lazy tensor; make it a plain, finished one."""
    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


def chunk_sizes(length: int, size: int) -> list[int]:
    """Every rank's token count when `length` tokens split over `size` ranks unevenly (the first ones one more)."""
    return [length // size + (rank < length % size) for rank in range(size)]


def sequence_to_heads(x: Tensor, group: dist.ProcessGroup, sizes: list[int] | None = None) -> Tensor:
    """(B, S/P, C) holding this rank's tokens -> (B, S, C/P) holding this rank's channel chunk.

    Channel chunk r (heads r*H/P ... (r+1)*H/P - 1 when C = H * head_dim) goes to rank r; the
    sequence is rebuilt in rank order, so rank r's input tokens land at [r*S/P, (r+1)*S/P).
    `sizes`: every rank's token count where they differ (`chunk_sizes`).
    """
    size = dist.get_world_size(group)
    batch, local_seq, channels = x.shape
    if channels % size:
        raise UserError(f"Ulysses attention splits {channels} channels over {size} ranks; they must divide")
    if sizes is not None and len(set(sizes)) > 1:  # (P, S_r, B, C/P) flat: chunk j of dim 0 goes to rank j
        send = x.reshape(batch, local_seq, size, channels // size).permute(2, 1, 0, 3)
        send = send.reshape(-1, batch, channels // size)
        received = _wait(funcol.all_to_all_single_autograd(send.contiguous(), sizes, [local_seq] * size, group))
        return received.permute(1, 0, 2)  # (S, B, C/P) in rank order -> (B, S, C/P)
    # (P, B, S/P, C/P): chunk j of dim 0 is sent to rank j.
    send = x.reshape(batch, local_seq, size, channels // size).permute(2, 0, 1, 3).contiguous()
    received = _wait(funcol.all_to_all_single_autograd(send, None, None, group))
    # received[r] = rank r's tokens, my channels.
    return received.permute(1, 0, 2, 3).reshape(batch, size * local_seq, channels // size)


def heads_to_sequence(x: Tensor, group: dist.ProcessGroup, sizes: list[int] | None = None) -> Tensor:
    """(B, S, C/P) holding this rank's channels -> (B, S/P, C/P * P) holding this rank's tokens."""
    size = dist.get_world_size(group)
    batch, seq, local_channels = x.shape
    if sizes is not None and len(set(sizes)) > 1:  # token chunk j (sizes[j] tokens) goes back to rank j
        mine = sizes[dist.get_rank(group)]
        send = x.permute(1, 0, 2).contiguous()
        received = _wait(funcol.all_to_all_single_autograd(send, [mine] * size, sizes, group))
        # (P, S_r, B, C/P): my tokens, rank r's channels, which go back in rank order
        return received.reshape(size, mine, batch, local_channels).permute(2, 1, 0, 3).reshape(batch, mine, -1)
    if seq % size:
        raise UserError(f"Ulysses attention splits {seq} tokens over {size} ranks; they must divide")
    # (P, B, S/P, C/P): token chunk j goes back to rank j.
    send = x.reshape(batch, size, seq // size, local_channels).permute(1, 0, 2, 3).contiguous()
    received = _wait(funcol.all_to_all_single_autograd(send, None, None, group))
    # received[r] = my tokens, rank r's channels: channels go back in rank order.
    return received.permute(1, 2, 0, 3).reshape(batch, seq // size, size * local_channels)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup, sizes: list[int] | None) -> Tensor:
        ctx.dim, ctx.rank, ctx.size, ctx.length = dim, dist.get_rank(group), dist.get_world_size(group), x.shape[dim]
        sizes = sizes or [ctx.length] * ctx.size
        ctx.start = sum(sizes[: ctx.rank])
        moved = x.movedim(dim, 0)
        if len(set(sizes)) > 1:  # all-gather takes equal pieces: pad to the longest, keep each rank's own
            moved = torch.cat([moved, moved.new_zeros(max(sizes) - ctx.length, *moved.shape[1:])])
        gathered = _wait(funcol.all_gather_single(moved.contiguous(), 0, group))
        if len(set(sizes)) > 1:
            gathered = torch.cat([part[:n] for part, n in zip(gathered.chunk(ctx.size), sizes)])
        return gathered.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        local = grad.narrow(ctx.dim, ctx.start, ctx.length) * ctx.size
        return local, None, None, None


def gather_sequence(x: Tensor, dim: int, group: dist.ProcessGroup, sizes: list[int] | None = None) -> Tensor:
    """Concatenate every rank's chunk along `dim` (rank order); every rank gets the full tensor.

    Every rank of a context-parallel group computes the same loss from this full output, so the
    output gradient is the same on each. Backward keeps this rank's slice of it and multiplies by
    the group size P: after backward each rank holds P x the gradient flowing through its own
    tokens, and *averaging* gradients over the cp group (what FSDP2 / DDP do over a mesh that
    includes cp) gives exactly the single-process gradient. No communication in backward.
    """
    return _GatherSequence.apply(x, dim, group, sizes)


def split_sequence(x: Tensor, dim: int, group: dist.ProcessGroup, uneven: bool = False) -> Tensor:
    """This rank's contiguous chunk of `x` along `dim` (a plain slice: its gradient is zero elsewhere); `uneven`:
    a length cp does not divide splits into `chunk_sizes`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = x.shape[dim]
    if length % size and uneven:
        sizes = chunk_sizes(length, size)
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank])
    if length % size:
        raise UserError(
            f"context parallel splits a sequence of {length} tokens over cp={size} ranks, which does not divide. "
            f"Use buckets whose token count (latent frames x latent height x latent width / patch^2) divides by "
            f"{size}, or lower parallel.cp."
        )
    return x.narrow(dim, rank * (length // size), length // size)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _wait(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _wait(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum of `x` over the group, on every rank. The gradient is summed too: each rank's output
    depends on every rank's input, and each rank's downstream gradient is its own share."""
    return _AllReduceSum.apply(x, group)


def local_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, T, C) held whole by every rank -> (B, T, C/P): this rank's channel chunk (its heads), no communication."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[-1] % size:
        raise UserError(f"Ulysses attention splits {x.shape[-1]} channels over {size} ranks; they must divide")
    width = x.shape[-1] // size
    return x.narrow(-1, rank * width, width)


def gather_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, T, C/P) of this rank's heads -> (B, T, C) of all heads, in rank order, on every rank.

    Backward reduce-scatters: rank r's heads receive the sum of every rank's gradient for them. With the
    context-parallel convention (the gradients of a stream held whole add up over the ranks to P x the
    single-process gradient), that is P x the true gradient of rank r's heads, as for the split tokens.
    """
    gathered = _wait(funcol.all_gather_single_autograd(x.movedim(-1, 0).contiguous(), 0, group))
    return gathered.movedim(0, -1)
