"""Attention backends through diffusers' dispatcher, on a tiny real Wan transformer: the kernel a
name selects really runs (same output as SDPA's default), several experts all switch, and
validation's backend is put back to training's afterwards."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from vt.train.attention import backend_for, check_backend, set_backend


def tiny_wan() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=1,
        rope_max_seq_len=32,
    ).eval()


def backends(model) -> set[str]:
    return {
        module.processor._attention_backend.value
        for module in model.modules()
        if getattr(getattr(module, "processor", None), "_attention_backend", None) is not None
    }


def test_backends_switch_every_attention_and_validation_restores_training():
    model = tiny_wan()
    inputs = (torch.randn(1, 16, 2, 8, 8), torch.tensor([500.0]), torch.randn(1, 8, 32))
    with torch.no_grad():
        assert set_backend(model, "native") == 2  # self- and cross-attention of the one block
        native = model(*inputs).sample
        set_backend(model, "native_math")
        assert backends(model) == {"_native_math"}
        math = model(*inputs).sample
    torch.testing.assert_close(math, native, rtol=1e-4, atol=1e-5)

    with backend_for(model, "native", restore="native_math"):
        assert backends(model) == {"native"}
    assert backends(model) == {"_native_math"}

    experts = torch.nn.ModuleDict({"high_noise": model, "low_noise": tiny_wan()})
    assert set_backend(experts, "native") == 4
    assert backends(experts["low_noise"]) == {"native"}


def test_unknown_and_cpu_incapable_backends_name_what_this_machine_has():
    with pytest.raises(ValueError, match=r"unknown; choose one of \['flash', 'flex'"):
        check_backend("fast", torch.device("cpu"))
    check_backend("flex", torch.device("cpu"), training=False)  # forward-only use (validation) is fine here
    with pytest.raises(ValueError, match="no CPU backward.*This machine can run: native, native_math$"):
        check_backend("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match="no backward, so it can only be used for validation"):
        check_backend("sage", torch.device("cpu"))
