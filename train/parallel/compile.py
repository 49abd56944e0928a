"""torch.compile per transformer block (after activation checkpointing, before FSDP).

Blocks are identical in structure, so one compiled graph serves them all (dynamo caches by code),
and compiling blocks rather than the whole model keeps FSDP's hooks and the spec's Python glue
(packing, embeddings) out of the graph. Only each block's `forward` is compiled, in place: the
module tree and parameter names do not change, so checkpoints and exports are unaffected.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, spec, **compile_kwargs) -> nn.Module:
    for block in spec.blocks(model):
        block.forward = torch.compile(block.forward, **compile_kwargs)
    return model
