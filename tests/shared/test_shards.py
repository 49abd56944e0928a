"""Latent shard format: safetensors round trip, self-describing metadata, commit records."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from vt.shared.shards import (
    FORMAT_VERSION,
    CommitRecord,
    ShardFormatError,
    decode_shard,
    encode_shard,
    read_shard_metadata,
)


def _header(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def test_round_trip_bf16_fp32_keys_meta():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "latents": torch.randn(3, 16, 3, 4, 4, generator=g).to(torch.bfloat16),
        "prompt_embeds": torch.randn(3, 8, 64, generator=g),
        "prompt_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.int64),
    }
    keys = ["clip-a", "clip-b", "clip-c"]
    meta = {"bucket": "9x64x96", "fingerprint": "ab12", "family": "ltx-video"}
    data = encode_shard(tensors, keys, meta)

    header = _header(data)  # plain safetensors: a JSON header, then raw tensor bytes (no pickle)
    assert header["latents"]["dtype"] == "BF16" and header["prompt_embeds"]["dtype"] == "F32"
    assert header["__metadata__"]["format_version"] == str(FORMAT_VERSION)

    out, out_keys, out_meta = decode_shard(data)
    assert out_keys == keys and out_meta == meta
    assert set(out) == set(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype
        assert torch.equal(out[name], tensor)


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="dim 0 must be the 2 samples"):
        encode_shard({"latents": torch.zeros(3, 4)}, ["a", "b"], {})
    with pytest.raises(ValueError, match="unique"):
        encode_shard({"latents": torch.zeros(2, 4)}, ["a", "a"], {})
    with pytest.raises(ValueError, match="JSON"):
        encode_shard({"latents": torch.zeros(1, 4)}, ["a"], {"bad": object()})


def test_decode_rejects_foreign_and_future_shards():
    foreign = save({"x": torch.zeros(1, 2)})
    with pytest.raises(ShardFormatError, match="not a vt latent shard"):
        decode_shard(foreign)
    future = save(
        {"x": torch.zeros(1, 2)},
        metadata={
            "format": "vt-latent-shard",
            "format_version": str(FORMAT_VERSION + 1),
            "keys": '["a"]',
            "meta": "{}",
        },
    )
    with pytest.raises(ShardFormatError, match="re-run vt-precompute"):
        read_shard_metadata(future)
    good = encode_shard({"x": torch.zeros(1, 2)}, ["a"], {})
    with pytest.raises(ShardFormatError, match="truncated"):
        decode_shard(good[:20])


def test_commit_record_round_trip_and_errors():
    record = CommitRecord(
        producer=1,
        seq=7,
        epoch=0,
        bucket="9x64x64",
        keys=["a", "b"],
        data="data/p1/00000007.safetensors",
        nbytes=123,
        sha256="f" * 64,
        fingerprint="abc",
    )
    assert CommitRecord.from_json(record.to_json()) == record
    obj = json.loads(record.to_json())
    del obj["sha256"]
    with pytest.raises(ShardFormatError, match="lacks sha256"):
        CommitRecord.from_json(json.dumps(obj).encode())
    with pytest.raises(ShardFormatError, match="not JSON"):
        CommitRecord.from_json(b"{half")
