"""Activation checkpointing and torch.compile per block change how a block runs, never what it computes
or what its weights are called (checkpoints and exports keep the plain names)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.train.parallel import apply_ac, apply_compile


@pytest.fixture(scope="module")
def wan(tiny_model_factory):
    spec = build_spec(ModelConfig(family="wan", path=str(tiny_model_factory("wan"))), frame_rate=8.0)
    torch.manual_seed(0)
    model = spec.load_transformer()
    spec.add_lora(model, rank=4, alpha=4.0, targets=None)
    with torch.no_grad():  # non-zero LoRA B, so adapter gradients flow everywhere
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    generator = torch.Generator().manual_seed(1)
    batch = {
        "latents": torch.randn(2, 16, 3, 8, 8, generator=generator),
        "prompt_embeds": torch.randn(2, 8, 64, generator=generator),
    }
    return spec, model, batch


def loss_and_grads(spec, model, batch):
    model.zero_grad(set_to_none=True)
    out = spec.forward(model, batch, torch.tensor([0.3, 0.7]), torch.ones_like(batch["latents"]))
    loss = ((out.prediction - out.target) ** 2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def plain_names(grads):
    return {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads.items()}


def test_activation_checkpointing_recomputes_blocks_with_the_same_result_and_names(wan):
    spec, model, batch = wan
    loss, grads = loss_and_grads(spec, model, batch)
    checkpointed = copy.deepcopy(model)
    apply_ac(checkpointed, spec)
    assert all(isinstance(b, CheckpointWrapper) for b in spec.blocks(checkpointed))
    calls = []
    for block in spec.blocks(checkpointed):  # count forward runs (module hooks do not fire on recompute)
        inner = block._checkpoint_wrapped_module
        inner.forward = (lambda run: lambda *a, **k: calls.append(1) or run(*a, **k))(inner.forward)
    ac_loss, ac_grads = loss_and_grads(spec, checkpointed, batch)

    assert len(calls) == 2 * len(spec.blocks(model)), "each block should run again in backward"
    assert torch.equal(ac_loss, loss)
    ac_grads = plain_names(ac_grads)
    assert ac_grads.keys() == grads.keys() and len(grads) > 0
    assert all(torch.allclose(ac_grads[n], grads[n], rtol=1e-5, atol=1e-7) for n in grads)
    assert checkpointed.state_dict().keys() == model.state_dict().keys()  # checkpoints and exports unchanged


def test_compiled_blocks_compute_the_same_loss_and_gradients(wan):
    spec, model, batch = wan
    loss, grads = loss_and_grads(spec, model, batch)
    compiled = copy.deepcopy(model)
    apply_compile(compiled, spec, backend="aot_eager")  # inductor codegen costs ~30 s on 2 CPU cores
    assert all(is_compiled(b) for b in spec.blocks(compiled))
    assert not is_compiled(compiled)  # only the blocks: the spec's glue and FSDP hooks stay eager

    c_loss, c_grads = loss_and_grads(spec, compiled, batch)
    assert torch.allclose(c_loss, loss, rtol=1e-5)
    assert c_grads.keys() == grads.keys()
    assert all(torch.allclose(c_grads[n], grads[n], rtol=1e-4, atol=1e-6) for n in grads)
    assert compiled.state_dict().keys() == model.state_dict().keys()


def is_compiled(block) -> bool:
    """Whether `apply_compile` replaced the block's forward with a compiled one."""
    return hasattr(block.__dict__.get("forward"), "_torchdynamo_orig_callable")
