"""A transformer's weights from one .safetensors file as the community ships them, ComfyUI's fp8-scaled files too.

`model.components.transformer = "/path/wan2.1_t2v_1.3B_fp8_scaled.safetensors"` (or a hub file,
`"org/repo/path/in/repo.safetensors"`, fetched with hf_hub_download) names the weights; the config stays
model.path's `transformer/config.json`, as diffusers' `from_single_file(config=...)` takes it.

Keys are read in diffusers' layout as they are, or in the original checkpoint's (`blocks.0.self_attn.q.weight`),
optionally under `model.diffusion_model.` / `diffusion_model.` (keys outside the prefix, a full checkpoint's VAE
and text encoders, are left out). The original layout is mapped by diffusers' own `checkpoint_mapping_fn` for the
transformer's class (`SINGLE_FILE_LOADABLE_CLASSES`), run once on meta tensors of the file's shapes while a
torch-function mode records which file tensors each result comes from (lineage.py):
- a tensor the mapping only renames comes back as the very object it was given, and is read from the file
  lazily, block by block (`Weights.read`), exactly as a diffusers-layout weight is;
- a tensor it computes (HunyuanVideo's fused `img_attn_qkv` split in three, a scale/shift swap) belongs to the
  group of file tensors it was computed from; a group is computed for real when one of its results is first
  read (the mapping run again with just that group's tensors real) and kept while the fill reads its other
  results (the last two groups). No whole copy of the model is ever held.

fp8-scaled files (ComfyUI): float8 weights with a per-tensor `<module>.scale_weight` (newer files: `.weight_scale`)
and a `scaled_fp8` marker tensor; the weight is `weight.float() * scale_weight`, which `read` returns. `scale(name)`
and `read_scaled` give the stored float8 block and its scale instead, which a frozen fp8 base keeps
(train/frozen_storage.py). `scale_input` / `input_scale` (ComfyUI's fp8 matmul of the activations, an inference
setting) has no part in training and is ignored. In a scaled file a float8 weight without its scale is an error:
read unscaled it would be silently wrong. A float8 file without scales (a plain cast) is read as stored.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from math import prod
from pathlib import Path

import torch
from torch import nn

from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.shared.weights.folder import Weights
from vt.shared.weights.gguf_file import GgufWeights
from vt.shared.weights.lineage import mapping_function, trace_mapping
from vt.shared.weights.packing import INT8, Packing

log = get_logger("vt.weights.single_file")
PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # ComfyUI's full checkpoints, its LoRA-style prefix
MARKER = "scaled_fp8"
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
INPUT_SCALE_SUFFIXES = (".scale_input", ".input_scale")  # ComfyUI's fp8 matmul of activations: inference only
QUANT_SUFFIX = ".comfy_quant"  # newer ComfyUI files: the layer's format as JSON bytes beside its `.weight_scale`
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALED = (*FP8, torch.int8)  # weight dtypes a file stores with a scale (ComfyUI's float8 and int8_tensorwise)
FP8_MAX = 448.0  # float8 e4m3fn's largest value: a new per-tensor scale is amax / 448
_HUB_FILE = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+)/(.+\.(?:safetensors|gguf))$")
SUFFIXES = (".safetensors", ".gguf")


class SingleFileError(UserError):
    """A single-file checkpoint vt cannot read as the model; the message names the key and what to do."""


def is_single_file(value: str | None) -> bool:
    return bool(value) and value.endswith(SUFFIXES)


def resolve_file(value: str, key: str) -> Path:
    """The local path of `value`: a file, or `org/repo/path.safetensors` on the hub (hf_hub_download)."""
    if Path(value).is_file():
        return Path(value)
    match = _HUB_FILE.match(value)
    if match is None or Path(value).exists():
        raise FileNotFoundError(
            f"{key} = {value!r} is neither a .safetensors or .gguf file nor a hub file "
            "(org/repo/path/in/repo.safetensors)"
        )
    from huggingface_hub import hf_hub_download

    repo, filename = match.groups()
    try:
        return Path(hf_hub_download(repo, filename))
    except Exception as err:  # offline, unknown repo or file: one line naming the key
        from vt.shared.models.components import ModelLoadError, hub_offline

        why = (
            "the hub is offline (HF_HUB_OFFLINE=1) and the file is not in the local cache"
            if hub_offline()
            else (str(err).strip().splitlines() or [type(err).__name__])[0]
        )
        raise ModelLoadError(
            f"cannot fetch {key} = {value!r} (no such local file; as a hub file: {filename} of "
            f"{repo}): {why}. Download it where there is network "
            f"(`hf download {repo} {filename} --local-dir DIR`) and set {key} to the local file"
        ) from err


class SingleFileWeights:
    """The tensors of a single-file checkpoint under the diffusers names of `model` (built on the meta device),
    with the reading interface of `Weights` (`in`, `names`, `shape`, `read`) plus `scale` / `read_scaled`."""

    def __init__(self, file: Path, model: nn.Module, key: str = "model.components.transformer"):
        self.file, self.key = Path(file), key
        self.raw = GgufWeights(self.file) if self.file.suffix == ".gguf" else Weights([self.file])
        self._cls = type(model).__name__
        self._config = dict(getattr(model, "config", {}))
        self._keys, self._scales = self._companions()
        params = {name: tuple(p.shape) for name, p in model.named_parameters()}
        persistent = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self._mapping = None
        if not set(params) <= set(self._keys):  # not diffusers' layout: map it with diffusers' own function
            self._mapping = mapping_function(type(model))
            if self._mapping is None:
                raise SingleFileError(
                    f"{key} = {str(file)!r}: its keys are not {self._cls}'s (e.g. {self._example()}) and diffusers has "
                    f"no single-file mapping for {self._cls}; convert the file to diffusers' layout, or point {key} at a "
                    "diffusers-layout folder"
                )
        self._renamed, self._computed, self._groups = self._trace()
        names = {**{n: s for n, (_, s) in self._renamed.items()}, **{n: s for n, (_, s, _) in self._computed.items()}}
        self._shapes = names
        missing = [n for n in params if n not in names]
        if missing:
            how = f"diffusers' {self._mapping.__name__}" if self._mapping else "reading it as diffusers' layout"
            raise SingleFileError(
                f"{key} = {str(file)!r} lacks {len(missing)} of {self._cls}'s {len(params)} parameters after "
                f"{how} (e.g. {missing[:3]}); the file's keys look like {self._example()}. The file is not this "
                "family's transformer in diffusers' layout nor in the original one; check model.family and the file"
            )
        wrong = [f"{n}: file {names[n]}, model {s}" for n, s in persistent.items() if n in names and names[n] != s]
        if wrong:
            raise SingleFileError(
                f"{key} = {str(file)!r} does not fit the config.json of model.path's transformer "
                f"({len(wrong)} shapes differ, e.g. {'; '.join(wrong[:3])}): another model size? "
                "Set model.path to the model the file belongs to"
            )
        if self._mapping is not None:
            log.info(
                "%s: original layout, mapped by diffusers' %s (%d tensors renamed, %d computed from %d groups)",
                self.file.name,
                self._mapping.__name__,
                len(self._renamed),
                len(self._computed),
                len(self._groups),
            )
        extra = [n for n in names if n not in persistent]
        if extra:
            log.warning(
                "%d tensors of %s are not in %s and are ignored (e.g. %s)",
                len(extra),
                self.file.name,
                self._cls,
                ", ".join(extra[:3]),
            )
        self._cache: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    # ----------------------------------------------------------------------------- the file's keys
    def _companions(self) -> tuple[dict[str, str], dict[str, str]]:
        """(key without the prefix -> file key, for the weights; weight key -> its scale's file key)."""
        names = self.raw.names()
        prefix = next((p for p in PREFIXES if any(n.startswith(p) for n in names)), "")
        keys = {n[len(prefix) :]: n for n in names if n.startswith(prefix)}
        marker = keys.pop(MARKER, None) or (MARKER if MARKER in names else None)
        scales: dict[str, str] = {}
        ignored = 0
        for name in list(keys):
            suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
            if suffix:
                scales[name[: -len(suffix)] + ".weight"] = keys.pop(name)
            elif name.endswith(INPUT_SCALE_SUFFIXES) or name.endswith(QUANT_SUFFIX):
                ignored += not name.endswith(QUANT_SUFFIX)
                keys.pop(name)
        where = f"{self.key} = {str(self.file)!r}"
        for weight, scale in scales.items():
            if weight not in keys:
                raise SingleFileError(f"{where}: {scale} scales {weight}, which the file lacks")
            stored = self.raw.entries[keys[weight]]
            if stored.dtype not in SCALED:
                raise SingleFileError(
                    f"{where}: {keys[weight]} is {str(stored.dtype)[6:]} with a scale (a format such "
                    "as ComfyUI's nvfp4 or mxfp8), which vt does not read; it reads float8 and int8 "
                    "weights with a scale, GGUF files and plain bf16 ones"
                )
            rows = stored.shape[0]
            if self.raw.entries[scale].shape not in [
                (),
                (1,),
                *([(rows,), (rows, 1)] if stored.dtype == torch.int8 else []),
            ]:
                raise SingleFileError(
                    f"{where}: {scale} has shape {self.raw.entries[scale].shape}; vt reads per-tensor "
                    "scales, and per-row ones (one per output feature) for int8 weights"
                )
        if marker or scales:
            unscaled = [keys[n] for n in keys if self.raw.entries[keys[n]].dtype in SCALED and n not in scales]
            if unscaled:
                raise SingleFileError(
                    f"{where} is scaled ({MARKER} / scale_weight / weight_scale tensors), but "
                    f"{'int8' if self.raw.entries[unscaled[0]].dtype == torch.int8 else 'float8'} {unscaled[0]} has no "
                    f"{unscaled[0].removesuffix('.weight')}.scale_weight ({len(unscaled)} such): read unscaled it "
                    "would be wrong. Use the file as it was written, or a bf16 one"
                )
            kinds = sorted({str(self.raw.entries[keys[w]].dtype)[6:] for w in scales})
            log.info(
                "%s: %s weights with scales (%d)%s",
                self.file.name,
                " and ".join(kinds),
                len(scales),
                f"; {ignored} input scales ignored: training computes without them" if ignored else "",
            )
        return keys, scales

    def _example(self) -> str:
        return ", ".join(list(self._keys)[:3])

    def _source_dtype(self, name: str) -> torch.dtype:
        dtype = self.raw.entries[self._keys[name]].dtype
        return torch.float32 if dtype in SCALED else dtype  # the mapping computes on dequantized float8 and int8

    def _meta_inputs(self) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(self.raw.entries[k].shape, dtype=self._source_dtype(name), device="meta")
            for name, k in self._keys.items()
        }

    def _run_mapping(self, checkpoint: dict[str, torch.Tensor]) -> dict:
        """The mapping over every weight key (real or meta tensors), or the keys as they are for diffusers' layout."""
        if self._mapping is None:
            return checkpoint
        try:
            return self._mapping(checkpoint=checkpoint, config=self._config)
        except Exception as err:  # diffusers' functions pop keys by name and split at fixed sizes
            raise SingleFileError(
                f"{self.key} = {str(self.file)!r}: diffusers' {self._mapping.__name__} cannot map it "
                f"({type(err).__name__}: {err}); its keys look like {self._example()}. Is it a {self._cls} checkpoint "
                "in the original layout, of the size model.path's config.json names?"
            ) from err

    def _trace(self):
        """Which diffusers name is which file tensor (renamed), and which are computed from groups of them."""
        return trace_mapping(
            self._meta_inputs(),
            self._run_mapping,
            self._mapping.__name__ if self._mapping else "reading as diffusers' layout",
        )

    # ----------------------------------------------------------------------------- the Weights interface
    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def scaled_modules(self) -> set[str]:
        """Modules whose weight the file stores in float8 e4m3fn with a per-tensor scale (diffusers names): what a
        frozen fp8 base keeps as stored. (An e5m2 weight, whose values e4m3fn cannot hold, is dequantized.)"""
        return {
            name.removesuffix(".weight")
            for name in self._shapes
            if name.endswith(".weight")
            and self._scale_keys(name)
            and all(self.raw.entries[self._keys[source]].dtype == torch.float8_e4m3fn for source in self._sources(name))
        }

    def quantized_modules(self) -> dict[str, Packing]:
        """Modules whose 2-D weight the file stores quantized and is read as it is (diffusers names): a GGUF file's
        ggml blocks, an int8 weight with its scale. What a LoRA's frozen base keeps as stored (train/packed_base.py)."""
        out = {}
        for name, (source, shape) in self._renamed.items():
            entry = self.raw.entries[self._keys[source]]
            if not name.endswith(".weight") or len(shape) != 2:
                continue
            if isinstance(self.raw, GgufWeights) and entry.qtype is not None and entry.stored == shape:
                out[name.removesuffix(".weight")] = Packing(entry.qtype, (entry.end - entry.start) // shape[0])
            elif entry.dtype == torch.int8 and source in self._scales:
                scale = self.raw.entries[self._scales[source]].shape
                out[name.removesuffix(".weight")] = Packing(INT8, shape[1], () if prod(scale) == 1 else (shape[0], 1))
        return out

    def read_packed(
        self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Rows of a weight `quantized_modules` names, as the file stores them: (rows, bytes per row) of ggml blocks,
        or the int8 values."""
        key = self._keys[self._renamed[name][0]]
        if not isinstance(self.raw, GgufWeights):
            return self.raw.read(key, offsets, shape)
        first, rows = (offsets[0], shape[0]) if offsets is not None and shape is not None else (0, None)
        return self.raw.read_packed(key, first, rows)

    def _sources(self, name: str) -> list[str]:
        """The file tensors (keys without the prefix) `name` is read or computed from."""
        return [self._renamed[name][0]] if name in self._renamed else sorted(self._computed[name][2])

    def _scale_keys(self, name: str) -> list[str | None]:
        """The scale (file key or None) of each file tensor `name` is read or computed from; [] if none is scaled."""
        keys = [self._scales.get(source) for source in self._sources(name)]
        return keys if any(keys) else []

    def _scale_rows(
        self, file_key: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """A weight's scale in float32: a scalar, or (rows, 1) of a per-row one (those of the block at `offsets`)."""
        value = self.raw.read(file_key).float()
        if value.numel() == 1:
            return value.reshape(())
        value = value.reshape(-1, 1)
        return value if offsets is None else value[offsets[0] : offsets[0] + shape[0]]

    def scale(self, name: str) -> torch.Tensor | None:
        """The per-tensor float32 scale of `name` as stored (`read_scaled` * scale = `read`); None if unscaled.
        A tensor computed from file tensors of one scale keeps it; of several, it gets its own (amax / 448)."""
        keys = self._scale_keys(name)
        if not keys:
            return None
        if len(set(keys)) == 1:
            return self._scale_rows(keys[0])
        return (self._full(name).abs().amax().float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)

    def read(
        self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Tensor `name` (or its block at `offsets` of `shape`) as the diffusers model holds it: the stored
        dtype, or float32 for a scaled float8 weight, dequantized (weight.float() * scale_weight)."""
        if name in self._renamed:
            source = self._renamed[name][0]
            block = self.raw.read(self._keys[source], offsets, shape)
            scale = self._scales.get(source)
            return block.float() * self._scale_rows(scale, offsets, shape) if scale else block
        return _block(self._full(name), offsets, shape)

    def read_scaled(
        self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The block of `name` whose product with `scale(name)` is `read`: the file's float8 values as stored for
        a renamed weight, float32 values on float8's grid for a computed one."""
        if name in self._renamed:
            return self.raw.read(self._keys[self._renamed[name][0]], offsets, shape)
        return _block(self._full(name), offsets, shape) / self.scale(name)

    def _full(self, name: str) -> torch.Tensor:
        """A computed tensor, from its group (computed when first asked, the last two groups kept)."""
        group = self._computed[name][0]
        if group not in self._cache:
            checkpoint = self._meta_inputs()
            for source in self._groups[group]:
                tensor = self.raw.read(self._keys[source])
                scale = self._scales.get(source)
                checkpoint[source] = (
                    tensor.float() * self._scale_rows(scale)
                    if scale
                    else tensor.float()
                    if tensor.dtype in SCALED
                    else tensor
                )
            out = self._run_mapping(checkpoint)
            self._cache[group] = {n: out[n] for n, (g, _, _) in self._computed.items() if g == group}
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        self._cache.move_to_end(group)
        return self._cache[group][name]


def _block(tensor: torch.Tensor, offsets, shape) -> torch.Tensor:
    if offsets is None:
        return tensor
    return tensor[tuple(slice(o, o + s) for o, s in zip(offsets, shape))].contiguous()


def load_weights(model: nn.Module, weights, device: str | torch.device = "cpu") -> nn.Module:
    """Fill a model built on the meta device (`empty_component`) from `weights`, one tensor at a time, straight
    onto `device`, each tensor in its parameter's dtype (a scaled float8 weight dequantized)."""
    persistent = set(model.state_dict(keep_vars=True))
    missing = [name for name, _ in model.named_parameters() if name not in weights]
    if missing:
        raise SingleFileError(f"the weights lack {len(missing)} parameters of the model (e.g. {missing[:3]})")
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            value = weights.read(name).to(device=device, dtype=param.dtype)
            model.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=param.requires_grad)
        for name, buffer in list(model.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            value = weights.read(name).to(buffer.dtype) if name in persistent and name in weights else buffer
            model.get_submodule(owner)._buffers[leaf] = value.to(device)
    return model
