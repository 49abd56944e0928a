"""Quantize a transformer's single .safetensors file into a GGUF file, as ComfyUI-GGUF's conversion writes them.

    python scripts/make_gguf.py wan2.1_t2v_14B_bf16.safetensors wan2.1_t2v_14B_Q8_0.gguf --qtype Q8_0 --arch wan

The keys stay the file's (the original checkpoint's layout, or diffusers'; a `model.diffusion_model.` prefix is
dropped). Weights of two dims whose rows are whole blocks are quantized to `--qtype`; everything else (biases,
norms, modulation tables, convolutions) is kept as it was, float32 for bfloat16 sources (exact); a tensor of more
than 4 dims (a patch embedding's Conv3d) is stored flattened to 2 dims, its shape in `comfy.gguf.orig_shape.<key>`,
as ComfyUI-GGUF reads it. The `gguf` package writes the blocks: Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 (its K-quants,
Q6_K / Q5_K / Q4_K, come from llama.cpp's quantize tool; vt reads those too). Use the file as
`model.components.transformer` (docs/memory.md: what each type saves).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

QTYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
PREFIX = "model.diffusion_model."


def write_gguf(tensors: dict[str, torch.Tensor], out: Path, qtype: str = "Q8_0", arch: str = "wan") -> dict[str, str]:
    """Write `tensors` to `out` (see the module docstring); returns key -> the type it was stored in."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    stored = {}
    for key, tensor in tensors.items():
        key = key.removeprefix(PREFIX)
        data = tensor.detach().float().numpy() if tensor.dtype == torch.bfloat16 else tensor.detach().numpy()
        if data.ndim == 2 and key.endswith(".weight") and data.shape[1] % block == 0:
            writer.add_tensor(key, gguf.quants.quantize(data.astype(np.float32), kind), raw_dtype=kind)
            stored[key] = qtype
        else:
            if data.ndim > 4:
                writer.add_array(f"comfy.gguf.orig_shape.{key}", [int(n) for n in data.shape])
                data = data.reshape(data.shape[0], -1)
            writer.add_tensor(key, np.ascontiguousarray(data))
            stored[key] = str(data.dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a transformer's .safetensors file")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--qtype", default="Q8_0", choices=QTYPES)
    parser.add_argument("--arch", default="wan", help="general.architecture (ComfyUI-GGUF: wan, hyvid, ltxv ...)")
    args = parser.parse_args(argv)
    from safetensors.torch import load_file

    stored = write_gguf(load_file(args.source), args.out, args.qtype, args.arch)
    quantized = sum(kind == args.qtype for kind in stored.values())
    print(f"{args.out}: {quantized} of {len(stored)} tensors in {args.qtype}, "
          f"{args.out.stat().st_size / 2**20:.1f} MiB (from {args.source.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
