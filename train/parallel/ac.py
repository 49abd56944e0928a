"""Activation checkpointing per transformer block: keep only block inputs, recompute in backward.

Every block of the spec's block lists (`spec.named_blocks`: the same blocks FSDP, TP, CP and compile
walk, e.g. HunyuanVideo's double- and single-stream blocks) is wrapped in torch's non-reentrant
checkpoint wrapper, in place in its ModuleList. Parameter names gain a `_checkpoint_wrapped_module.` segment, which the
wrapper's state-dict hook and torch.distributed.checkpoint's name resolution both strip, so
checkpoints and LoRA exports keep the plain names and load into a model without checkpointing.
"""

from __future__ import annotations

from torch import nn


def apply_ac(model: nn.Module, spec) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for name, block in spec.named_blocks(model):
        wrapped = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False
        )  # blocks draw no random numbers
        model.set_submodule(name, wrapped)
    return model
