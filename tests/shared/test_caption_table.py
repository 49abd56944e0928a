"""Text stored once per caption, trimmed: every family's transformer sees what it saw before.

Per family through its real tiny encoders and transformer: a shard of four samples with three
distinct captions (one empty) stores three trimmed captions, and decoding gives each sample its
caption's tensors; tensors the family leaves unmasked come back bit for bit, masked ones equal on
the rows the mask keeps, and the transformer's prediction on the decoded batch is bit-identical.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.caption_table import INDEX, ROWS_PREFIX, Captions, decode_caption, encode_caption
from vt.shared.config import ModelConfig
from vt.shared.models import FAMILIES, build_spec
from vt.shared.shards import ShardFormatError, decode_shard, encode_shard

CAPTIONS = ["a cat", "a big brown dog runs across the green grass of a sunny park", "a cat", ""]


def _stored(data: bytes) -> dict:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_caption_is_stored_once_trimmed_and_the_transformer_sees_the_same(family, tiny_model_factory):
    spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family))), 8.0)
    encoders = spec.load_stage1()
    with torch.no_grad():
        table = Captions.of(CAPTIONS, lambda captions: spec.encode_text(encoders, captions), spec.text_masks)
    assert table.index == [0, 1, 0, 2]
    expected = {name: tensor[table.index] for name, tensor in table.conditions.items()}  # v1: per sample, padded
    g = spec.geometry
    frames = 1 if spec.single_frame else g.temporal + 1  # the shortest clip the VAE takes (MiniMax H3: 17k+5)
    latents = torch.randn(
        4,
        *spec.latent_shape(Bucket(frames, g.spatial * g.patch * 2, g.spatial * g.patch * 2)),
        generator=torch.Generator().manual_seed(0),
    )
    keys = [f"k{i}" for i in range(4)]

    data = encode_shard({"latents": latents}, keys, {}, table)
    padded_layout = encode_shard({"latents": latents, **expected}, keys, {})
    decoded, out_keys, _ = decode_shard(data)

    assert out_keys == keys and set(decoded) == {"latents", *expected}
    header = _stored(data)
    for name, tensor in expected.items():
        kept = header[ROWS_PREFIX + name]["shape"]
        assert kept == [3]  # three distinct captions, each once
        if name in spec.text_masks:
            mask = expected[spec.text_masks[name]] != 0
            assert torch.equal(decoded[name][mask], tensor[mask])
        else:
            assert torch.equal(decoded[name], tensor), f"{family}: {name} must come back bit for bit"
    assert header[INDEX]["shape"] == [4]
    assert len(data) < len(padded_layout)
    if spec.text_masks or any((t[:, -1] == 0).all() for t in expected.values()):  # padding to trim: much smaller
        assert len(data) < 0.6 * len(padded_layout)

    transformer = spec.load_transformer()
    sigmas = torch.tensor([0.2, 0.4, 0.6, 0.8])
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    # A family that trains on a control video also reads what stage 1 stores of it (per sample, not text).
    side = g.spatial * g.patch * 2
    control = (
        {
            name: torch.randn(4, *shape, generator=torch.Generator().manual_seed(2))
            for name, shape in spec.condition_shapes(Bucket(frames, side, side)).items()
            if name != "latents" and name not in expected
        }
        if spec.control_video
        else {}
    )
    with torch.no_grad():
        before = spec.forward(transformer, {"latents": latents, **expected, **control}, sigmas, noise).prediction
        after = spec.forward(transformer, {**decoded, **control}, sigmas, noise).prediction
    # Bit-identical; NaN where it was NaN before (HunyuanVideo's empty caption keeps no token after its template).
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(before[:3]).all()  # the real captions' predictions are numbers

    empty = decode_caption(encode_caption({n: t[2:3] for n, t in table.conditions.items()}, spec.text_masks))
    assert set(empty) == set(expected)
    for name in set(expected) - set(spec.text_masks):
        assert torch.equal(empty[name], table.conditions[name][2])


def test_a_version_1_shard_is_refused_with_the_fix():
    from safetensors.torch import save

    old = save(
        {"latents": torch.zeros(1, 2)},
        metadata={"format": "vt-latent-shard", "format_version": "1", "keys": '["a"]', "meta": "{}"},
    )
    with pytest.raises(ShardFormatError, match="version 1 is not 2 .*re-run vt-precompute"):
        decode_shard(old)
