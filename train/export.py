"""Exports at the end of a run, without one host holding the whole model.

- LoRA (or another adapter kind, adapter.kind): only the adapters are gathered (to rank 0's CPU), then
  written by the spec (diffusers and ComfyUI files).
- Full weights: a diffusers-layout folder (config.json, `diffusion_pytorch_model[-0000i-of-0000n].safetensors`
  and their index) written tensor by tensor. The file layout and every tensor's byte range follow from
  the shapes and dtypes alone, so each file's header is written first; then every rank gathers one
  tensor at a time (the collective) and rank 0 appends its bytes. Nothing holds more than one whole
  tensor. Under pipeline stages each tensor comes from the stage that holds it, in the one-process
  order (parallel/pp_export.py), so the files are the ones one process writes. Tensors are written in
  the dtype `from_pretrained` loads them in (`model.dtype`, float32 for the class's
  `_keep_in_fp32_modules`), not as the float32 master weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vt.shared.adapters import is_adapter, saved_name
from vt.shared.models.components import keeps_float32
from vt.shared.weights.folder import DTYPES
from vt.train.checkpoint import gather_full_state_dict
from vt.train.experts import expert_modules
from vt.train.parallel.pp import pipeline_split
from vt.train.parallel.pp_export import StageStream

SAFETENSORS_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_FILE_BYTES = 5 * 2**30  # per safetensors file; a larger model is split over several, with an index
WEIGHTS_NAME = "diffusion_pytorch_model"


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def lora_states(model: nn.Module, adapter: str = "default") -> dict[str | None, dict[str, torch.Tensor]]:
    """The adapters of the training model (plain, sharded, or an nn.ModuleDict of experts) under peft's saved
    names (`...lora_A.weight`, `...hada_w1_a`; shared/adapters.py), per expert (None: the one transformer), on
    rank 0; {} on the other ranks.
    Every rank must call it: only the adapters are gathered."""
    state = gather_full_state_dict(model, trainable_only=True)
    if not _is_main():
        return {}
    experts = list(model.keys()) if isinstance(model, nn.ModuleDict) else [None]
    out: dict[str | None, dict[str, torch.Tensor]] = {expert: {} for expert in experts}
    for name, tensor in state.items():
        if not is_adapter(name):
            continue
        expert = None
        if experts != [None]:
            expert, name = name.split(".", 1)
        out[expert][saved_name(name, adapter)] = tensor.detach().cpu()
    return out


def write_full_weights(model: nn.Module, out_dir: Path, dtype_of, max_file_bytes: int = MAX_FILE_BYTES) -> Path:
    """Write `model` (plain, sharded or split into pipeline stages; every rank calls this) as a diffusers-layout
    folder `out_dir`. `dtype_of(name, tensor)` is the dtype each floating tensor is written in."""
    out = Path(out_dir)
    state = model.state_dict()  # plain names (wrappers strip theirs); sharded tensors stay DTensors
    split = pipeline_split(model)
    if split is not None:  # pipeline stages: each tensor streamed from its stage to the writer, in order
        stream = StageStream(model, state, split, dtype_of)
        entries, fetch = stream.entries, stream.fetch
    else:
        entries = []
        for name, tensor in state.items():
            dtype = dtype_of(name, tensor) if tensor.is_floating_point() else tensor.dtype
            size = tensor.numel() * torch.empty((), dtype=dtype).element_size()
            entries.append((name, tuple(tensor.shape), dtype, size))
        dtypes = {name: dtype for name, _, dtype, _ in entries}

        def fetch(name: str) -> torch.Tensor | None:
            tensor = state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # a collective when sharded
            return (
                full.detach().to("cpu", dtypes[name]).contiguous().reshape(-1).view(torch.uint8) if _is_main() else None
            )

    files = _split(entries, max_file_bytes)
    if _is_main():
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob(f"{WEIGHTS_NAME}*.safetensors*"):  # an earlier export's files
            old.unlink()
        model.save_config(out)
    for index, group in enumerate(files):
        name = _file_name(index, len(files))
        handle = _open_with_header(out / name, group) if _is_main() else None
        try:
            for tensor_name, *_ in group:
                data = fetch(tensor_name)
                if handle is not None:
                    handle.write(data.numpy().tobytes() if data.numel() else b"")
                del data
        finally:
            if handle is not None:
                handle.close()
    if _is_main() and len(files) > 1:
        weight_map = {name: _file_name(i, len(files)) for i, group in enumerate(files) for name, *_ in group}
        total = sum(size for group in files for *_, size in group)
        (out / f"{WEIGHTS_NAME}.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    if dist.is_initialized():
        dist.barrier()
    return out


def _split(entries: list, max_file_bytes: int) -> list[list]:
    files, current, size = [], [], 0
    for entry in entries:
        if current and size + entry[3] > max_file_bytes:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry[3]
    return [*files, current] if current else files


def _file_name(index: int, count: int) -> str:
    return f"{WEIGHTS_NAME}.safetensors" if count == 1 else f"{WEIGHTS_NAME}-{index + 1:05d}-of-{count:05d}.safetensors"


def _open_with_header(path: Path, group: list):
    """`path` opened for writing, the safetensors header for `group` already written (8-byte aligned)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, size in group:
        header[name] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    handle = open(path, "wb")
    handle.write(len(text).to_bytes(8, "little"))
    handle.write(text)
    return handle


def export_run(transformer: nn.Module, spec, mode: str, root: Path, step: int, barrier) -> None:
    """The LoRA files or full weights of `transformer` under `root` (every rank calls this): a run over all experts
    writes each expert's (LoRA files named after the expert, full weights in model/<its pipeline component>/)."""
    if mode == "lora":
        for expert, tensors in lora_states(transformer).items():  # {} off rank 0
            spec.save_lora(tensors, root / "lora", expert=expert, step=step)
        barrier()
        return
    experts = spec.trained_experts
    for expert, module in expert_modules(transformer).items():
        folder = root / "model" / experts[expert] if expert else root / "model"
        write_full_weights(
            module,
            folder,
            dtype_of=lambda name, tensor, module=module: (
                torch.float32 if keeps_float32(module, name) else spec.frozen_dtype
            ),
        )


def export_path(spec, mode: str, run_dir: Path) -> Path:
    """Where `export_run` writes under `run_dir` (LoRA file or model folder), known on every rank."""
    if spec.trains_all_experts:  # one file or folder per expert in it
        return run_dir / ("lora" if mode == "lora" else "model")
    if mode == "lora":
        return run_dir / "lora" / "pytorch_lora_weights.safetensors"
    return run_dir / "model"
