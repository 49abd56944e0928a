"""ggml's block quantizations, dequantized with torch: the formats of GGUF files (ComfyUI-GGUF's video models).

A quantized tensor is a sequence of blocks along its last dim, each `BLOCK_SIZES[qtype]` = (values, bytes). Written
from ggml's block layouts (ggml-common.h; the `gguf` package's numpy `quants.dequantize` is the reference the tests
compare with, on random blocks of every format), in torch so that a layer can dequantize its own weight on the device
it computes on, for each matmul:

- Q8_0: 32 values, a float16 scale d and 32 int8: d q.
- Q4_0 / Q5_0: 32 values, d and 4-bit (plus a 5th bit, `qh`) codes: d (q - 8) / d (q - 16); Q4_1 / Q5_1 add a
  float16 minimum m: d q + m. Values 0-15 are the low nibbles, 16-31 the high ones.
- Q4_K / Q5_K: 256 values in 8 sub-blocks of 32, float16 d and dmin, 6-bit sub-block scales and mins packed in
  12 bytes: d sc q - dmin m; each 32 bytes of codes hold two sub-blocks (low nibbles, then high ones); Q5_K's fifth
  bits are `qh`, bit 2i and 2i+1 for sub-blocks 2i and 2i+1.
- Q6_K: 256 values in 16 sub-blocks of 16, 4 low bits (`ql`), 2 high bits (`qh`), int8 scales and d: d sc (q - 32).
"""

from __future__ import annotations

import torch

# ggml type ids (GGMLQuantizationType) -> (values per block, bytes per block)
BLOCK_SIZES = {
    8: (32, 34),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
NAMES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def _half(raw: torch.Tensor) -> torch.Tensor:
    """(blocks, 2) uint8 little-endian float16s -> (blocks, 1) float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """(blocks, n) bytes -> (blocks, 2n): the low nibbles, then the high ones."""
    return torch.cat([raw & 0x0F, raw >> 4], dim=1)


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """(blocks, count / 8) bytes -> (blocks, count) of their bits, least significant first."""
    shifts = torch.arange(8, device=raw.device, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :count]


def _legacy(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    d = _half(blocks[:, :2])
    if qtype == 8:
        return d * blocks[:, 2:].contiguous().view(torch.int8).float()
    has_min = qtype in (3, 7)
    m = _half(blocks[:, 2:4]) if has_min else None
    start = 4 if has_min else 2
    fifth = qtype in (6, 7)
    codes = _nibbles(blocks[:, start + 4 * fifth :]).float()
    if fifth:
        codes = codes + 16 * _bits(blocks[:, start : start + 4], 32).float()
    if has_min:
        return d * codes + m
    return d * (codes - (16 if fifth else 8))


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> (scales, mins), each (blocks, 8) of 6 bits: sub-blocks 0-3 in the low 6 bits of
    bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-3 / 4-7."""
    low, high, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low & 63, (rest & 0x0F) | ((low >> 6) << 4)], dim=1)
    mins = torch.cat([high & 63, (rest >> 4) | ((high >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k_quants(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    n = blocks.shape[0]
    if qtype == 14:  # Q6_K: ql[128] qh[64] scales[16] d
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d = _half(blocks[:, 208:210])
        out = []
        for half in range(2):  # each 128 values: 64 bytes of ql, 32 of qh
            low, high = ql[:, 64 * half : 64 * half + 64], qh[:, 32 * half : 32 * half + 32]
            parts = [(low[:, :32] & 0x0F), (low[:, 32:] & 0x0F), (low[:, :32] >> 4), (low[:, 32:] >> 4)]
            out += [(part | (((high >> (2 * i)) & 3) << 4)).float() - 32 for i, part in enumerate(parts)]
        codes = torch.stack(out, dim=1).view(n, 16, 16)  # 16 sub-blocks of 16, in order
        return (d.unsqueeze(-1) * scales.unsqueeze(-1) * codes).view(n, 256)
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144] if qtype == 12 else blocks[:, 48:176]
    chunks = qs.view(n, 4, 32)  # each 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high ones
    codes = torch.stack([chunks & 0x0F, chunks >> 4], dim=2).view(n, 8, 32).float()
    if qtype == 13:  # Q5_K: qh[32], bit j of byte l is value l of sub-block j
        shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8).view(1, 8, 1)
        codes = codes + 16 * ((blocks[:, 16:48].unsqueeze(1) >> shifts) & 1).float()
    return (d.unsqueeze(-1) * scales.unsqueeze(-1) * codes - dmin.unsqueeze(-1) * mins.unsqueeze(-1)).view(n, 256)


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of `raw` (uint8, rows of whole blocks: (..., bytes per row)) of ggml type `qtype`, as
    (..., values per row) in `dtype`."""
    if qtype not in BLOCK_SIZES:
        raise ValueError(f"ggml type {qtype} is not one vt dequantizes; types: {sorted(NAMES.values())}")
    values, nbytes = BLOCK_SIZES[qtype]
    if raw.dtype != torch.uint8 or raw.shape[-1] % nbytes:
        raise ValueError(
            f"{NAMES[qtype]} rows must be uint8 whole blocks of {nbytes} bytes, got {raw.dtype} {tuple(raw.shape)}"
        )
    blocks = raw.reshape(-1, nbytes)
    out = _k_quants(blocks, qtype) if values == 256 else _legacy(blocks, qtype)
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes * values).to(dtype)


def row_bytes(qtype: int, values: int) -> int:
    """Bytes of a row of `values` values of type `qtype` (a multiple of its block)."""
    size, nbytes = BLOCK_SIZES[qtype]
    if values % size:
        raise ValueError(f"{NAMES[qtype]} rows hold multiples of {size} values, not {values}")
    return values // size * nbytes
