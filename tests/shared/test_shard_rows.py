"""Rows of a committed shard read by byte range (shared/shard_rows.py), on a local window and on S3:
the same tensors as decoding the whole shard, only the rows' bytes read, and every changed byte that a
reader reads is caught, whichever piece it is in."""

from __future__ import annotations

import pytest
import torch

from vt.shared.caption_table import Captions
from vt.shared.shards import decode_shard, encode_shard
from vt.shared.window import Reader, ShardCorruptError, open_reader, open_writer

ROWS = 8


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "window")
    return request.getfixturevalue("s3_bucket") + f"/{tmp_path.name}"  # a window per test and parameter


def make_shard() -> tuple[bytes, list[str]]:
    """8 samples: bf16 latents, a float32 per-sample tensor, and 5 captions (three samples share one) whose
    text is trimmed to different lengths, with a mask."""
    generator = torch.Generator().manual_seed(0)
    keys = [f"clip{i}" for i in range(ROWS)]
    latents = torch.randn(ROWS, 4, 2, 3, 3, generator=generator).to(torch.bfloat16)
    first_frame = torch.randn(ROWS, 5, generator=generator)
    embeds = torch.randn(5, 6, 4, generator=generator)
    mask = torch.zeros(5, 6, dtype=torch.int64)
    for caption, length in enumerate([6, 2, 4, 1, 3]):
        mask[caption, :length] = 1
    captions = Captions(
        {"prompt_embeds": embeds, "prompt_attention_mask": mask},
        [0, 1, 1, 2, 3, 1, 4, 0],
        {"prompt_embeds": "prompt_attention_mask"},
    )
    return encode_shard({"latents": latents, "first_frame": first_frame}, keys, {"bucket": "9x64x64"}, captions), keys


def committed(uri: str):
    writer = open_writer(uri, size="keep")
    writer.register_producer(0, 1)
    data, keys = make_shard()
    record = writer.commit(0, 0, 0, data, "9x64x64", keys, "fp")
    return open_reader(uri), record, data


def count_ranges(window: Reader) -> list[tuple[int, int]]:
    """Every byte range the window's storage is asked for, from now on."""
    asked: list[tuple[int, int]] = []
    read_ranges = window.storage.read_ranges
    window.storage.read_ranges = lambda rel, ranges: (asked.extend(ranges), read_ranges(rel, ranges))[1]
    return asked


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6, 7], [3], [6, 7], [7, 2, 5]])
def test_rows_equal_the_whole_shards_rows_and_only_their_bytes_are_read(uri, rows):
    window, record, data = committed(uri)
    assert record.header_bytes > 0 and record.header_sha256
    whole, keys, _ = decode_shard(data)
    asked = count_ranges(window)
    layout = window.read_header(record)
    assert layout.keys == keys
    read = window.read_rows(record, layout, rows)
    assert read.keys() == whole.keys()
    for name, tensor in whole.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor[rows]), name
    fetched = sum(b - a for a, b in asked)
    if len(rows) == 1:  # one sample of eight: its rows, its caption and the small table, plus the header
        row_bytes = sum(t[0].numel() * t.element_size() for n, t in whole.items() if not n.startswith("prompt"))
        assert fetched < record.header_bytes + row_bytes + 512, (fetched, record.nbytes)
        assert fetched - record.header_bytes < 0.3 * (record.nbytes - record.header_bytes)


def test_a_changed_byte_is_caught_in_the_piece_read_and_only_there(tmp_path):
    window, record, data = committed(str(tmp_path / "window"))
    layout = window.read_header(record)
    path = tmp_path / "window" / record.data
    latents = layout.tensors["latents"]
    broken = bytearray(data)
    broken[latents.start + 5 * latents.row_bytes + 1] ^= 0xFF  # sample 5's latents
    path.write_bytes(bytes(broken))
    assert torch.equal(window.read_rows(record, layout, [4])["latents"], decode_shard(data)[0]["latents"][[4]])
    with pytest.raises(ShardCorruptError, match="sample row 5"):
        window.read_rows(record, layout, [4, 5])
    text = layout.tensors["text.prompt_embeds"]
    broken = bytearray(data)
    broken[text.start + 2] ^= 0xFF  # caption 0's text: samples 0 and 7
    path.write_bytes(bytes(broken))
    window.read_rows(record, layout, [1, 2])
    with pytest.raises(ShardCorruptError, match="caption 0"):
        window.read_rows(record, layout, [7])
    broken = bytearray(data)
    broken[20] ^= 0x01  # the header
    path.write_bytes(bytes(broken))
    with pytest.raises(ShardCorruptError, match="header"):
        window.read_header(record)


def test_a_shard_without_row_digests_is_read_whole_and_checked(tmp_path):
    """A window an older vt wrote: records without header fields. The trainer's reader reads such shards
    whole (checked against the record's sha256) and still gives the rows asked for."""
    from vt.shared.shards import CommitRecord
    from vt.train.data import BatchReader

    window, record, data = committed(str(tmp_path / "window"))
    old = CommitRecord.from_json(
        record.to_json().replace(b'"header_bytes": %d' % record.header_bytes, b'"header_bytes": 0')
    )
    assert old.header_bytes == 0
    reader = BatchReader(
        window,
        4,
        on_read=lambda position: None,
        order=lambda position, block=True: old if position == 0 else None,
        dp_rank=1,
        dp_size=2,
    )
    batches = list(reader)
    whole, _, _ = decode_shard(data)
    assert [b.first for b in batches] == [2, 2]
    assert torch.equal(batches[1].tensors["latents"], whole["latents"][6:8].float())
