"""The trained transformer, built without ever holding a whole copy: on the meta device, laid out, filled.

    empty (meta; each parameter in its load dtype) -> fp8 storage, LoRA adapters or what a full
    fine-tune trains (float32) -> parallelize: TP, CP, checkpointing, compile, FSDP2 (shards of
    nothing yet) -> materialize on the device -> fill each parameter's local shard -> DDP

- Dtypes: frozen weights (a LoRA's base, whatever a full fine-tune freezes) are read from the file
  into `model.dtype` (float32 for the class's `_keep_in_fp32_modules`, as `from_pretrained` does;
  float8 with `frozen_base.fp8`); only what trains is float32. Where the run computes in
  another dtype than the frozen weights are stored in (fp8; bf16 weights without autocast, e.g. on a
  CPU), each layer is upcast for its compute (store_frozen). A full fine-tune without autocast keeps
  its few frozen weights float32, since nothing would cast between them.
- Host blocks: with block swap (`host_blocks`) the frozen weights of the swapped blocks are made in host
  memory, one page-locked arena per block (vt.shared.host_memory), and filled there, so the device only ever
  holds what stays on it: the start-up peak is the steady state's weights. A base quantized at read is quantized
  on the host, tensor by tensor (each layer's scale copied as soon as its weight is), before anything reaches the
  device.
- Fill: each rank reads from the safetensors files only the block of each tensor that its shard
  holds (`Weights.read` at the DTensor's local offsets): under FSDP2 start-up memory and bytes read
  fall as 1/N, a single process fills straight onto its GPU, and there is no whole copy anywhere.
  (`fill_from="rank0"`, where rank 0 reads every tensor and scatters it, exists for the benchmark
  that compares the two: scripts/bench_memory.py.)
- A single-file transformer (`model.components.transformer = "file.safetensors"`, shared/weights/single_file.py)
  fills the same way, through the same reading interface: renamed tensors block by block, tensors diffusers'
  mapping computes from their group. Its fp8-scaled weights are dequantized into `model.dtype`, or with
  `frozen_base.fp8` kept as stored, float8 values and per-tensor scale (train/frozen_storage.py).
- LoRA adapters start as peft's default (lora_A Kaiming-uniform, lora_B zero) drawn from a generator
  keyed by (train.seed, component, parameter name): the same adapters in every layout and on every
  rank, with no broadcast. The other kinds (adapter.kind) start so too (shared/adapters.py: the zero factor
  zero, the others Kaiming-uniform); DoRA's magnitude is the base weight's row norms, computed once the base is
  filled, each rank from its own rows (FSDP2 shards the base weight and the magnitude alike, by rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vt.shared import adapters
from vt.shared.errors import UserError
from vt.shared.host_memory import HostBuffer, layout_bytes, views
from vt.shared.log import get_logger
from vt.shared.weights.packing import Packing
from vt.shared.weights.quantize import QuantizingWeights
from vt.train.fp8 import FP8_STORAGE
from vt.train.frozen_storage import store_frozen
from vt.train.packed_base import PackedLinear, linear_packings, pack_frozen

__all__ = [
    "Dtypes",
    "prepare_transformer",
    "build_transformer",
    "materialize",
    "fill",
    "plain_name",
    "lora_init",
    "fill_magnitudes",
]
log = get_logger("vt.train.model")

# Segments wrappers add to parameter names: activation checkpointing's and torch.compile's.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    """A parameter's name as the model itself names it (without wrapper segments)."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def file_key(name: str) -> str | None:
    """The checkpoint key of a parameter or buffer: its plain name without peft's `base_layer.`; None
    for adapters (of any kind), which no checkpoint holds."""
    name = plain_name(name)
    if adapters.is_adapter(name):
        return None
    return name.replace(".base_layer.", ".")


def lora_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """peft's default start for the adapter weight `name` (plain name) of any kind: lora_A Kaiming-uniform
    (a = sqrt 5), lora_B zero, and so on (shared/adapters.py); drawn from a generator keyed by (seed, name).
    DoRA's magnitude starts zero here: `fill_magnitudes` sets it from the filled base weight."""
    return adapters.initial(name, shape, seed)


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of a run's transformer, for the trainer and `vt-train plan` alike."""

    autocast: torch.dtype | None  # the autocast dtype, None without autocast
    model: torch.dtype  # model.dtype: what frozen weights are stored in
    mode: str  # train.mode
    fp8_base: bool = False  # frozen_base.fp8 (train/parts/frozen_base.py)

    @property
    def compute(self) -> torch.dtype:
        """What the frozen weights compute in: the autocast dtype, else float32."""
        return self.autocast or torch.float32

    @property
    def frozen(self) -> torch.dtype:
        """What frozen weights load in: `model.dtype`, except beside a full fine-tune's float32 weights
        without autocast, where nothing would cast between the two."""
        return torch.float32 if self.mode == "full" and self.autocast is None else self.model

    @property
    def pipeline_parts(self) -> torch.dtype:
        """What validation's other pipeline parts (the VAE, text connectors) load and compute in: as the
        transformer computes, `model.dtype` under autocast, else float32."""
        return self.model if self.autocast else torch.float32

    def storage(self, mode: str) -> torch.dtype | None:
        """The frozen weights' storage dtype when it is not their compute dtype (None when it is): float8
        for fp8 base weights, `model.dtype` without autocast (layers upcast for their compute)."""
        if self.fp8_base and mode == "lora":
            return FP8_STORAGE
        if mode != "full" and self.autocast is None and self.model != torch.float32:
            return self.model
        return None

    def param_dtype(self, mode: str) -> torch.dtype | None:
        """FSDP2's param dtype: the autocast dtype, the compute dtype for float8-stored frozen weights (the
        all-gather upcasts them), else None (each parameter gathered as stored; bf16 linears upcast per
        matmul, train/frozen_storage.py)."""
        return self.autocast or (self.compute if self.storage(mode) == FP8_STORAGE else None)


def prepare_transformer(
    spec,
    component: str,
    *,
    mode: str,
    lora: dict | None,
    storage_dtype: torch.dtype | None,
    sharded: bool,
    compute_dtype: torch.dtype,
    frozen_dtype: torch.dtype,
    scaled: Collection[str] = (),
    packed: dict[str, Packing] | None = None,
    quantize: str = "none",
) -> nn.Module:
    """Transformer `component` of `spec` on the meta device, set up to train: `mode` "lora" (adapters per
    `lora`: rank, alpha, targets and kind, adapter.kind), "full" (what `spec.full_trainable` marks) or "frozen"
    (nothing trains: validation's other expert); float32 for whatever trains. `storage_dtype`: the frozen weights'
    storage when it is not what they compute in (fp8 base weights; bf16 computed in float32), see store_frozen;
    `scaled`: the modules whose float8 weights the file stores with a per-tensor scale (kept with fp8 storage);
    `packed`: those whose weights a LoRA's base keeps in the file's quantized blocks (train/packed_base.py);
    `quantize`: frozen_base.quantize, every linear layer of a LoRA's base in one process quantized so."""
    model = spec.empty_component(component, dtype=frozen_dtype)
    if quantize != "none" and mode == "lora" and not sharded:
        packed = linear_packings(model, quantize)
    if storage_dtype is not None:  # before LoRA: the adapters stay float32
        store_frozen(
            model,
            storage_dtype,
            compute_dtype,
            sharded=sharded,
            gather_stored=storage_dtype != FP8_STORAGE,
            scaled=scaled if storage_dtype == FP8_STORAGE else (),
        )
    kind = lora.get("kind", "lora") if mode == "lora" else None
    if kind == "dora" and (packed or storage_dtype == FP8_STORAGE):
        raise UserError(
            'adapter.kind = "dora" needs the base weights as numbers (DoRA divides by their row norms '
            "in every forward), but this base is kept "
            + ("in the file's quantized blocks (a quantized checkpoint in one process)" if packed else "in float8")
            + '; adapter.kind = "lora" trains '
            "on it, or use a full-precision checkpoint"
        )
    if packed and mode == "lora":
        pack_frozen(model, packed, compute_dtype)
    model.requires_grad_(False)
    if mode == "lora":
        # On a meta-built model the adapters are made on the meta device too (`fill` gives them their start): peft
        # would otherwise make and initialize each on the host first (~1 GB of Kaiming draws for a 14B's rank 32).
        on_meta = all(p.is_meta for p in model.parameters())
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            spec.add_lora(model, lora["rank"], lora["alpha"], lora["targets"] or None, kind=kind)
    elif mode == "full":
        spec.full_trainable(model)
    for param in model.parameters():  # float32 for whatever trains (master weights under FSDP2's mixed precision)
        if param.requires_grad:
            param.data = param.data.float()
    return model


def build_transformer(
    spec,
    component: str,
    world,
    *,
    mode: str,
    lora: dict | None,
    storage_dtype: torch.dtype | None,
    compute_dtype: torch.dtype,
    frozen_dtype: torch.dtype,
    parallelize: Callable[[nn.Module, Callable[[nn.Module], None]], None],
    seed: int,
    cpu_offload: bool = False,
    quantize: str = "none",
    host_blocks: Callable[[nn.Module], list[nn.Module]] | None = None,
) -> nn.Module:
    """`prepare_transformer`'s model, laid out and filled: `parallelize(model, materialize)` applies the
    parallel plan and calls `materialize` once its shards exist. With `cpu_offload` the shards are made in
    CPU memory (FSDP2 keeps them there and copies each block to the device for its all-gather) and the
    buffers on the device. `host_blocks(laid-out model)`: blocks whose frozen weights are made, filled (and
    quantized) in host memory, never on the device (block swap's)."""
    weights = spec.weights(component)
    sharded = world.dims.fsdp_enabled or world.dims.tp > 1
    if quantize != "none" and mode == "lora":
        if weights.quantized_modules():
            raise UserError(
                f"frozen_base.quantize = {quantize!r} quantizes a full-precision base, but the {component} "
                "file is quantized already; keep it as stored (unset frozen_base.quantize)"
            )
        if sharded and world.is_main:
            log.info(
                "%s: frozen_base.quantize = %r is for one process; a sharded layout keeps model.dtype",
                component,
                quantize,
            )
        weights = weights if sharded else QuantizingWeights(weights, quantize)
        if not sharded and world.is_main:
            log.info(
                "%s: %d linear weights quantized to %s as they are read (frozen_base.quantize)",
                component,
                len(weights.quantized_modules()),
                quantize,
            )
    scaled = weights.scaled_modules()
    packed = quantized_base(weights, mode, sharded, world.is_main, component, frozen_dtype)
    if scaled and storage_dtype != FP8_STORAGE and world.is_main:
        log.info(
            "%s: %d fp8-scaled weights dequantized into %s; frozen_base.fp8 = true keeps them in float8 "
            "with their scales (half the memory of bf16)",
            component,
            len(scaled),
            str(frozen_dtype)[6:],
        )
    model = prepare_transformer(
        spec,
        component,
        mode=mode,
        lora=lora,
        storage_dtype=storage_dtype,
        sharded=world.dims.fsdp_enabled,
        compute_dtype=compute_dtype,
        frozen_dtype=frozen_dtype,
        scaled=scaled,
        packed=packed,
    )

    def materialize_and_fill(laid_out: nn.Module) -> None:
        materialize(
            laid_out,
            torch.device("cpu") if cpu_offload else world.device,
            host_blocks=host_blocks(laid_out) if host_blocks is not None else (),
        )
        fill(laid_out, weights, seed=seed, key=component)
        if cpu_offload:
            for module in laid_out.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(world.device)

    parallelize(model, materialize_and_fill)
    return model


def quantized_base(
    weights, mode: str, sharded: bool, main: bool, component: str, frozen_dtype: torch.dtype
) -> dict[str, Packing]:
    """The modules a LoRA run keeps in the file's quantized blocks (`weights.quantized_modules()`): all of them in
    one process; none when another mode trains them or a sharded layout fills them dequantized (logged)."""
    quantized = weights.quantized_modules()
    if quantized and (mode != "lora" or sharded):
        if main:
            log.info(
                "%s: %d quantized weights dequantized into %s (%s)",
                component,
                len(quantized),
                str(frozen_dtype).removeprefix("torch."),
                "a sharded layout" if sharded else f"train.mode {mode}",
            )
        return {}
    return quantized


def materialize(model: nn.Module, device: torch.device, host_blocks: Collection[nn.Module] = ()) -> None:
    """Give the meta parameters (plain or sharded) storage on `device`, keeping the buffers the constructor
    computed (non-persistent ones, such as rotary tables, are in no checkpoint). The frozen parameters of
    `host_blocks` get theirs in host memory instead, one arena per block (vt.shared.host_memory: page-locked
    for a CUDA `device`, exactly their bytes), which the block keeps; nothing of them is ever on the device."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers() if not buffer.is_meta}
    if host_blocks:
        _materialize_apart(model, device, host_blocks)
    else:
        model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def _materialize_apart(model: nn.Module, device: torch.device, host_blocks: Collection[nn.Module]) -> None:
    """`to_empty(device)` by hand, parameter by parameter, with `host_blocks`' frozen ones in host arenas (one
    process: no FSDP2 parameter, whose `to_empty` only the module itself may do)."""
    made: dict[int, nn.Parameter] = {}
    for block in host_blocks:
        frozen = [p for p in block.parameters() if not p.requires_grad]
        shapes = [(p.shape, p.dtype) for p in frozen]
        arena = HostBuffer(layout_bytes(shapes), device)
        block._vt_host_arena = arena  # the block keeps its arena (and its page lock) as long as it lives
        for param, view in zip(frozen, views(arena.bytes, shapes)):
            made[id(param)] = nn.Parameter(view, requires_grad=False)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
            module._parameters[name] = made[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's local tensor, its offsets in the global tensor, its shape)."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(offsets), tuple(shape)
    return tensor, (0,) * tensor.ndim, tuple(tensor.shape)


@torch.no_grad()
def fill(model: nn.Module, weights, seed: int, key: str = "", fill_from: str = "slices") -> None:
    """Fill every parameter (and every persistent buffer the checkpoint holds) of a materialized model:
    checkpoint tensors from `weights`, adapters from `lora_init` keyed by (`seed`, `key`, name), then DoRA's
    magnitudes from their base weights (`fill_magnitudes`).

    `fill_from="slices"`: each rank reads its own block of each tensor. `"rank0"`: rank 0 reads whole
    tensors and scatters them (every rank must call this). A layer with a `weight_scale` slot (fp8-scaled file,
    fp8 storage) gets the file's float8 values and their scale (`weights.read_scaled`, `weights.scale`)."""
    missing = []
    slots = _scale_slots(model, weights)
    packed = {plain_name(f"{n}.weight") for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    persistent = {plain_name(name) for name in model.state_dict(keep_vars=True)}
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if plain_name(n) in persistent)]
    for name, tensor in tensors:
        checkpoint_key = file_key(name)
        if checkpoint_key is None:
            full = lambda: lora_init(
                f"{key}.{plain_name(name)}" if key else plain_name(name),  # noqa: E731
                tuple(tensor.shape),
                seed,
            )
        elif checkpoint_key in weights:
            full = None
            read = (
                weights.read_packed
                if plain_name(name) in packed
                else weights.read_scaled
                if plain_name(name) in slots
                else weights.read
            )
        elif isinstance(tensor, nn.Parameter):
            missing.append(checkpoint_key)
            continue
        else:
            continue  # a buffer the checkpoint does not hold keeps what the constructor computed
        if fill_from == "rank0" and isinstance(tensor, DTensor):
            _scatter_from_rank0(tensor, full() if full else read(checkpoint_key) if dist.get_rank() == 0 else None)
            continue
        local, offsets, shape = _local(tensor)
        if full is not None:
            block = full()[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
        else:
            if tuple(weights.shape(checkpoint_key)) != tuple(tensor.shape) and plain_name(name) not in packed:
                raise UserError(
                    f"checkpoint tensor {checkpoint_key} has shape {weights.shape(checkpoint_key)}, the "
                    f"model's {tuple(tensor.shape)}: the weights do not match the component's config"
                )
            block = read(checkpoint_key, offsets, shape)
        local.copy_(block)
        del block
        if plain_name(name) in slots:  # its scale at once: a base quantized at read holds it only until then
            scale, scale_key = slots.pop(plain_name(name))
            scale.copy_(weights.scale(scale_key))
    if missing:
        raise UserError(
            f"the checkpoint lacks {len(missing)} parameters of the model (e.g. {missing[:3]}): the "
            "weights do not match the component's config"
        )
    for scale, checkpoint_key in slots.values():  # (a scale slot whose weight was scattered from rank 0)
        scale.copy_(weights.scale(checkpoint_key))
    fill_magnitudes(model)


@torch.no_grad()
def fill_magnitudes(model: nn.Module) -> None:
    """DoRA's magnitudes from their filled base weights (peft's start: the rows' norms), each rank from the
    rows it holds: FSDP2 shards a base weight and its magnitude by the same rows (TP is refused for DoRA)."""
    for name, module in model.named_modules():
        magnitudes = getattr(module, adapters.MAGNITUDE, None)
        if not isinstance(magnitudes, nn.ModuleDict) or not magnitudes:
            continue
        base, base_offsets, base_shape = _local(module.get_base_layer().weight)
        for layer in magnitudes.values():
            local, offsets, shape = _local(layer.weight)
            if (offsets[0], shape[0]) != (base_offsets[0], base_shape[0]) or len(base_shape) != 2:
                raise RuntimeError(
                    f"{name}: DoRA's magnitude holds rows {offsets[0]}+{shape[0]} on this rank, its "
                    f"base weight rows {base_offsets[0]}+{base_shape[0]} (internal error)"
                )
            local.copy_(adapters.row_norms(base))


def _scale_slots(model: nn.Module, weights) -> dict[str, tuple[torch.Tensor, str]]:
    """plain weight name -> (its layer's `weight_scale` buffer, the weight's checkpoint key), for every layer
    store_frozen gave a scale slot; each must have a scale in `weights`."""
    slots = {}
    quantized = weights.quantized_modules()  # their scales are there by construction
    for name, module in model.named_modules():
        scale = module._buffers.get("weight_scale")
        if scale is not None:
            key = file_key(f"{name}.weight")
            if key.removesuffix(".weight") not in quantized and weights.scale(key) is None:
                raise ValueError(f"{key} has a scale slot but the checkpoint has no scale for it (internal error)")
            slots[plain_name(f"{name}.weight")] = (scale, key)
    return slots


def _scatter_from_rank0(tensor: DTensor, full: torch.Tensor | None) -> None:
    """Rank 0's whole tensor scattered into every rank's shard (distribute_tensor from rank 0)."""
    from torch.distributed.tensor import distribute_tensor

    source = (full if full is not None else torch.empty(tensor.shape)).to(tensor.device_mesh.device_type, tensor.dtype)
    shard = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=0)
    tensor.to_local().copy_(shard.to_local())
