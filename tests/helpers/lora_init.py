"""Adapters that change the output: peft starts lora_B at zero, so an export test first draws them."""

from __future__ import annotations

import torch


def randomise_lora(transformer: torch.nn.Module, seed: int = 3, scale: float = 0.3) -> None:
    """Fill every LoRA weight of `transformer` with seeded normal values of std `scale`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
