"""GGUF files: ggml's blocks dequantized in torch as the `gguf` package's own numpy code does, and a file's tensors read
whole or a block of rows at a time (the shards a layout fills), in their own shape where the file stores them reshaped.

Random blocks stand for real ones: every byte pattern is a valid block, but for the float16 scales, drawn here in
[-1, 1]. The `gguf` package quantizes only the legacy types (Q8_0 ... Q4_0), so the K-quant tensors of the file are
written from such blocks directly, as llama.cpp's quantize tool would store them.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vt.shared.errors import UserError
from vt.shared.weights.gguf_file import GgufWeights
from vt.shared.weights.gguf_quants import BLOCK_SIZES, NAMES, dequantize

SCALES = {14: (208,), 12: (0, 2), 13: (0, 2), 3: (0, 2), 7: (0, 2)}  # byte offsets of a block's float16 scales


def random_blocks(qtype: int, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 (rows, bytes per row) of random blocks of `qtype` with finite float16 scales."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCK_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, nbytes), dtype=np.uint8)
    for offset in SCALES.get(qtype, (0,)):
        halves = rng.uniform(-1, 1, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, blocks_per_row * nbytes)


@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES), ids=lambda q: NAMES[q])
def test_every_block_type_dequantizes_as_the_gguf_package(qtype):
    raw = random_blocks(qtype, rows=3, blocks_per_row=4, seed=qtype)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    got = dequantize(torch.from_numpy(raw), qtype)
    assert got.shape == expected.shape == (3, 4 * BLOCK_SIZES[qtype][0])
    assert np.array_equal(got.numpy(), expected)
    assert dequantize(torch.from_numpy(raw), qtype, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(torch.from_numpy(raw[:, :-1].copy()), qtype)


def test_a_files_tensors_read_whole_and_by_rows_in_their_own_shape(tmp_path):
    """A Q4_K and a Q6_K weight (K-quant blocks as stored), a Q8_0 one quantized by the package, a float16 bias and
    a 5-D tensor stored flattened in Q8_0 with its shape in `comfy.gguf.orig_shape.<name>`, as ComfyUI-GGUF reads it."""
    rng = np.random.default_rng(1)
    q8 = rng.standard_normal((6, 64)).astype(np.float32)
    conv = rng.standard_normal((4, 2, 1, 2, 8)).astype(np.float32)  # 32 values a row: one Q8_0 block
    stored = {
        "blocks.0.q.weight": (12, random_blocks(12, 5, 2)),
        "blocks.0.o.weight": (14, random_blocks(14, 4, 1)),
        "blocks.0.k.weight": (8, gguf.quants.quantize(q8, gguf.GGMLQuantizationType.Q8_0)),
        "patch.weight": (8, gguf.quants.quantize(conv.reshape(4, -1), gguf.GGMLQuantizationType.Q8_0)),
    }
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), arch="wan")
    writer.add_array("comfy.gguf.orig_shape.patch.weight", list(conv.shape))
    for name, (qtype, raw) in stored.items():
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(qtype))
    bias = rng.standard_normal(6).astype(np.float16)
    writer.add_tensor("blocks.0.k.bias", bias)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    weights = GgufWeights(tmp_path / "model.gguf")
    assert set(weights.names()) == {*stored, "blocks.0.k.bias"}
    for name, (qtype, raw) in stored.items():
        expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)))
        if name == "patch.weight":
            expected = expected.reshape(conv.shape)
            assert weights.shape(name) == conv.shape and weights.entries[name].stored == (4, 32)
        assert weights.qtype(name) == qtype and torch.equal(weights.read(name), expected), name
        assert torch.equal(
            weights.read(name, (1, 0, *[0] * (expected.ndim - 2)), (2, *expected.shape[1:])), expected[1:3]
        ), name
    assert torch.equal(
        weights.read("blocks.0.q.weight", (2, 128), (3, 256)), weights.read("blocks.0.q.weight")[2:, 128:384]
    )
    assert torch.equal(
        weights.read_packed("blocks.0.q.weight", 1, 2), torch.from_numpy(stored["blocks.0.q.weight"][1][1:3])
    )
    assert weights.read("blocks.0.k.bias").dtype == torch.float16
    assert torch.equal(weights.read("blocks.0.k.bias"), torch.from_numpy(bias))
    assert weights.qtype("blocks.0.k.bias") is None


def test_a_type_vt_cannot_dequantize_is_a_clear_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), arch="wan")
    writer.add_tensor("w.weight", np.zeros((2, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(UserError, match="IQ2_XXS, which vt does not dequantize .* Q4_K"):
        GgufWeights(tmp_path / "iq.gguf")
