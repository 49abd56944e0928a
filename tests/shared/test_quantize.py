"""Quantization as a base is read (shared/weights/quantize.py): NF4 stores each weight as the nearest of QLoRA's 16
levels times its 64-weight block's absmax, int8 as round(weight / scale) with a scale per row."""

from __future__ import annotations

import torch

from vt.shared.weights.quantize import NF4_BLOCK, NF4_LEVELS, dequantize_nf4, packing, quantize_int8_rows, quantize_nf4


def test_nf4_keeps_the_nearest_level_of_each_block_and_packs_two_codes_a_byte():
    weight = torch.randn(300, 128, generator=torch.Generator().manual_seed(0)) * 0.02  # 300 rows: two row chunks
    codes, absmax = quantize_nf4(weight)
    assert codes.dtype == torch.uint8 and codes.shape == (300, 64) and absmax.shape == (300, 2)
    blocks = weight.reshape(300, 2, NF4_BLOCK)
    peak = blocks.abs().amax(dim=2, keepdim=True)
    nearest = NF4_LEVELS[(blocks / peak).unsqueeze(-1).sub(NF4_LEVELS).abs().argmin(-1)] * peak
    assert torch.equal(dequantize_nf4(codes, absmax), nearest.reshape(300, 128))
    assert torch.equal(absmax, peak.squeeze(-1))
    assert dequantize_nf4(codes, absmax, torch.bfloat16).dtype == torch.bfloat16
    low = NF4_LEVELS[(codes & 0x0F).long()]  # the even columns live in the low nibbles
    assert torch.equal(low * absmax.repeat_interleave(32, dim=1), dequantize_nf4(codes, absmax)[:, 0::2])


def test_int8_rows_have_their_own_scale_and_widths_nf4_cannot_block_are_left_alone():
    weight = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * torch.arange(1, 6).view(5, 1)
    values, scale = quantize_int8_rows(weight, chunk=2)
    assert values.dtype == torch.int8 and scale.shape == (5, 1)
    assert torch.equal(scale, weight.abs().amax(dim=1, keepdim=True) / 127)
    assert (values.float() * scale - weight).abs().max() <= scale.max() / 2 + 1e-7
    assert packing("nf4", 8, 128).row_bytes == 64 and packing("nf4", 8, 100) is None
    assert packing("int8", 8, 100).scale == (8, 1)
