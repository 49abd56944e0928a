"""Quantize a transformer's single .safetensors file into the quantized files vt trains LoRAs on, as ComfyUI reads them.

    python scripts/quantize_base.py wan2.1_t2v_14B_bf16.safetensors wan2.1_t2v_14B_Q8_0.gguf --format Q8_0 --arch wan
    python scripts/quantize_base.py wan2.1_t2v_14B_bf16.safetensors wan2.1_t2v_14B_int8.safetensors --format int8

The keys stay the file's (the original checkpoint's layout, or diffusers'; a `model.diffusion_model.` prefix is
dropped). Weights of two dims are quantized; everything else (biases, norms, modulation tables, convolutions) is
kept as it was, float32 for bfloat16 sources (exact). Formats:
- GGUF (ComfyUI-GGUF's): Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 blocks written by the `gguf` package, for weights whose rows
  are whole blocks; a tensor of more than 4 dims (a patch embedding's Conv3d) stored flattened to 2 dims, its shape
  in `comfy.gguf.orig_shape.<key>`. (K-quants, Q6_K / Q5_K / Q4_K, come from llama.cpp's quantize tool; vt reads
  those too.)
- int8 (ComfyUI's `int8_tensorwise` layers): `<module>.weight` int8 = round(weight / scale), `.weight_scale` =
  amax / 127 in float32, `.comfy_quant` = the layer's format as JSON bytes; `--per-row` writes one scale per output
  feature ((out, 1), finer, which vt reads but ComfyUI's int8_tensorwise does not).
Use the file as `model.components.transformer` (docs/families.md, "A transformer from one file").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

QTYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
INT8 = "int8"
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


def write_int8(tensors: dict[str, torch.Tensor], out: Path, per_row: bool = False) -> dict[str, str]:
    """Write `tensors` to `out` with each 2-D weight as ComfyUI's int8 layers (see the module docstring); returns
    key -> the type it was stored in."""
    from safetensors.torch import save_file

    layer = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    state, stored = {}, {}
    for key, tensor in tensors.items():
        key = key.removeprefix(PREFIX)
        tensor = tensor.detach().float() if tensor.dtype == torch.bfloat16 else tensor.detach()
        if tensor.ndim == 2 and key.endswith(".weight"):
            amax = tensor.float().abs().amax(dim=1, keepdim=True) if per_row else tensor.float().abs().amax()
            scale = (amax / 127).clamp_min(torch.finfo(torch.float32).tiny)
            module = key.removesuffix(".weight")
            state[key] = (tensor.float() / scale).round().clamp(-127, 127).to(torch.int8)
            state[f"{module}.weight_scale"] = scale
            if not per_row:
                state[f"{module}.comfy_quant"] = layer.clone()
            stored[key] = INT8
        else:
            state[key], stored[key] = tensor.contiguous(), str(tensor.dtype).removeprefix("torch.")
    save_file(state, str(out))
    return stored


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a transformer's .safetensors file")
    parser.add_argument("out", type=Path, help="the file to write: .gguf for a GGUF format, .safetensors for int8")
    parser.add_argument("--format", default="Q8_0", choices=(*QTYPES, INT8))
    parser.add_argument("--arch", default="wan", help="GGUF: general.architecture (ComfyUI-GGUF: wan, hyvid, ltxv ...)")
    parser.add_argument("--per-row", action="store_true", help="int8: a scale per output feature")
    args = parser.parse_args(argv)
    from safetensors.torch import load_file

    if (args.format == INT8) != (args.out.suffix == ".safetensors"):
        parser.error(f"--format {args.format} writes a {'.safetensors' if args.format == INT8 else '.gguf'} file")
    tensors = load_file(args.source)
    stored = (
        write_int8(tensors, args.out, args.per_row)
        if args.format == INT8
        else write_gguf(tensors, args.out, args.format, args.arch)
    )
    quantized = sum(kind == args.format for kind in stored.values())
    print(
        f"{args.out}: {quantized} of {len(stored)} tensors in {args.format}, "
        f"{args.out.stat().st_size / 2**20:.1f} MiB (from {args.source.stat().st_size / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
