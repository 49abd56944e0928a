"""Activation checkpointing per transformer block: keep only block inputs, recompute in backward.

Each block of the spec's block list is wrapped in torch's non-reentrant checkpoint wrapper, in
place in its ModuleList. Parameter names gain a `_checkpoint_wrapped_module.` segment, which the
wrapper's state-dict hook and torch.distributed.checkpoint's name resolution both strip, so
checkpoints and LoRA exports keep the plain names and load into a model without checkpointing.
"""

from __future__ import annotations

from torch import nn


def apply_ac(model: nn.Module, spec) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    blocks = getattr(model, spec.blocks_attr)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}.{spec.blocks_attr} is not a ModuleList of blocks; "
                        f"fix blocks_attr of the {spec.family} spec")
    for index, block in enumerate(blocks):
        blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                           preserve_rng_state=False)  # blocks draw no random numbers
    return model
