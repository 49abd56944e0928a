"""`vt-train plan CONFIG`: memory per rank before a run, from the components' config files alone.

Nothing is loaded: the transformer is built as the trainer builds it (train/model_build.py) but on the
meta device, so every tensor's shape and dtype are exact, and the code that needs memory at run time
(a training step's forward and backward, the VAE encoding a clip or decoding a video, the text
encoders) runs on fake tensors (vt.shared.memory_trace), which measures its working memory without
computing anything. Per rank, for the config's layout over `gpus` ranks:

- weights: each tensor's bytes over the ranks that shard it (FSDP2 over dp_shard x cp, the TP plan's
  layers over tp); a run that trains one expert of two also holds the other (frozen) for validation;
- gradients and optimizer: float32 gradients and AdamW's two moments of what trains, sharded alike;
- buffers: FSDP2's gathered blocks in the compute dtype (the one running and the next one prefetched,
  with the all-gather's own buffers), the root's gathered parameters, a full fine-tune's block of
  unsharded gradients with its reduce-scatter buffers, DDP's gradient buckets;
- activations: one micro-batch (this rank's share of the bucket's batch: train.batch_size, or what fits
  token_budget.tokens_per_batch) of each bucket, the largest counted, through
  the family's forward and a backward, with and without activation checkpointing, divided over cp;
- validation: the VAE and the pipeline's other frozen parts, and the most the pipeline's steps or the VAE's decode
  hold at once;
- stage 1: each producer's encoders in model.dtype (float32 on a CPU) and what encoding the largest bucket needs.
With `parallel.cpu_offload`, weights, gradients and optimizer state are host memory, not GPU memory.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from vt.shared.buckets import parse_buckets
from vt.shared.config import Config
from vt.shared.host_memory import aligned
from vt.shared.memory_trace import StepTrace, fake_mode, fake_parameters
from vt.shared.models import spec_for
from vt.shared.runtime import encoder_dtype
from vt.train import refusals
from vt.train.model_build import Dtypes, prepare_transformer, quantized_base
from vt.train.parallel.dims import ParallelDims, layout_plan
from vt.train.parallel.fsdp import ROOT_UNIT
from vt.train.parallel.fsdp import units as fsdp_units
from vt.train.parallel.offload import OffloadSaved
from vt.train.parts import ModelMemory, Parts, RunContext

GIB = 2**30


@dataclass
class RankPlan:
    """Bytes one rank needs, on its device and in host memory.

    A run's device memory is phases: start-up (the model built and filled: the weights that stay on the device,
    nothing else), training (a step's gradients, freed after each optimizer step, its activations and the blocks
    block swap has in flight) and validation (the pipeline's parts, loaded for it and moved to host memory after
    it, and its working memory); weights, optimizer state and buffers are resident from the first step on. The
    device total is the largest of start-up and resident plus the larger of training and validation. Host memory
    (`host_total`) is what the run keeps there all along: CPU offload's weights, gradients and optimizer state
    (`host`), block swap's arenas (`swapped`), activation offload's arena (`offloaded`), the validation pipeline's
    parts between validations (`validation_host`)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    buffers: int = 0
    activations: int = 0
    validation: int = 0
    host: int = 0  # parallel.cpu_offload: weights, gradients and optimizer state in host memory
    swapped: int = 0  # block_swap.blocks_on_gpu: the swapped blocks' frozen weights in host memory (not in `weights`)
    in_flight: int = 0  # block_swap.blocks_on_gpu: the swapped frozen weights on the device at once (two blocks)
    offloaded: int = 0  # activation_offload.enabled: the host arena of one micro-step's saved inputs
    validation_host: int = 0  # the validation pipeline's parts (the VAE ...) in host memory between validations
    startup: int = 0  # on the device while the model is built and filled
    fill: int = 0  # in host memory while the model is filled: the largest tensor read at once

    @property
    def resident(self) -> int:
        return self.buffers + (0 if self.host else self.weights + self.optimizer)

    @property
    def training(self) -> int:
        return self.activations + self.in_flight + (0 if self.host else self.gradients)

    @property
    def validating(self) -> int:
        return self.validation + (self.in_flight if self.validation else 0)

    @property
    def device_total(self) -> int:
        return max(self.startup, self.resident + max(self.training, self.validating))

    @property
    def host_total(self) -> int:
        """Host memory from the first step on."""
        return self.host + self.swapped + self.offloaded + self.validation_host

    @property
    def host_peak(self) -> int:
        """The most host memory at once: from the first step on, or at start-up (the arenas being filled and the
        tensor being read)."""
        return max(self.host_total, self.host + self.swapped + self.fill)


@dataclass
class Plan:
    config: Config
    dims: ParallelDims
    device: str
    rank: RankPlan
    activations: dict[str, dict[str, int]] = field(default_factory=dict)  # bucket -> {"checkpointing": b, "none": b}
    stage1: dict[str, int] = field(default_factory=dict)  # encoder -> bytes, "working" / "working_tiled" -> bytes
    validation: dict[str, int] = field(default_factory=dict)  # "frozen", "step", "decode" / "decode_tiled" -> bytes
    micro_batch: int = 1  # the largest bucket's; with token_budget.tokens_per_batch each bucket has its own
    micro_batches: dict[str, int] = field(default_factory=dict)  # bucket -> samples per rank per micro-step
    vae_tiled: bool = False  # validation decodes tiled (validation.vae_tiling, "auto" against the budget)
    # FLOPs of one micro-batch's forward and backward of the largest bucket, {"none": ..., "checkpointing": ...}
    # (memory_trace.FlopCount over the fake step; checkpointing adds the blocks' recomputed forward): step_cost.py
    flops: dict[str, int] = field(default_factory=dict)
    dequantized: int = 0  # bytes a quantized base's layers unpack in one pass (forward, or backward): step_cost.py
    offload_largest: int = 0  # the largest saved input activation offload moves (its first copy back is exposed)

    def micro_for(self, bucket: str) -> int:
        """Samples per rank in a micro-step of `bucket`."""
        return self.micro_batches.get(bucket, self.micro_batch)

    def stage1_peak(self, tiled: bool | None = None) -> int:
        """Bytes one producer needs on its device: with `precompute.text_encoder_offload = "none"` every
        encoder beside the VAE's work; otherwise the text phase (its encoders) and the VAE phase (the VAE,
        an audio encoder, and the VAE's work) apart, the larger of the two."""
        tiled = self.config.precompute.vae_tiling is True if tiled is None else tiled
        working = self.stage1.get("working_tiled" if tiled else "working", 0)
        spec = spec_for(self.config)
        text = set(spec.stage1_components) - {"vae", *(spec.sound.components if spec.sound else ())}
        encoders = {name: size for name, size in self.stage1.items() if not name.startswith("working")}
        text_bytes = sum(size for name, size in encoders.items() if name in text)
        vae_phase = sum(size for name, size in encoders.items() if name not in text) + working
        if self.config.precompute.text_encoder_offload == "none":
            return text_bytes + vae_phase
        return max(text_bytes, vae_phase)

    def stage1_host(self) -> int:
        """Bytes one producer holds in host memory beyond the process itself: the text encoders where they wait
        between text phases (`text_encoder_offload` "model": page-locked, "blocks": streamed from there), and the
        decoded clips (uint8) of the shards waiting for their text phase (`precompute.text_phase_shards`) and of the
        bucket buffers."""
        pre, spec = self.config.precompute, spec_for(self.config)
        text = set(spec.stage1_components) - {"vae", *(spec.sound.components if spec.sound else ())}
        waiting = (
            sum(size for name, size in self.stage1.items() if name in text) if pre.text_encoder_offload != "none" else 0
        )
        largest = _largest(self.config)
        clips = (
            (pre.text_phase_shards + 1) * pre.samples_per_shard * 3 * largest.frames * largest.height * largest.width
        )
        return waiting + clips


@dataclass
class _Layout:
    """Which ranks share each tensor: the FSDP2 shard group and, for the TP plan's layers, the tp group."""

    fsdp: int
    tp: int
    split: set[str]

    @classmethod
    def of(cls, spec, model: nn.Module, dims: ParallelDims) -> "_Layout":
        split: set[str] = set()
        if dims.tp > 1:
            plan = layout_plan(spec, "tp")
            for where, _ in spec.named_blocks(model):
                for layer in plan.colwise:
                    split |= {
                        f"{where}.{layer}.weight",
                        f"{where}.{layer}.bias",
                        f"{where}.{layer}.base_layer.weight",
                        f"{where}.{layer}.base_layer.bias",
                        f"{where}.{layer}.lora_B.default.weight",
                    }
                for layer in plan.rowwise:
                    split |= {
                        f"{where}.{layer}.weight",
                        f"{where}.{layer}.base_layer.weight",
                        f"{where}.{layer}.lora_A.default.weight",
                    }
                split |= {f"{where}.{norm}.weight" for norm in plan.head_norms}
        return cls(dims.dp_shard * dims.cp if dims.fsdp_enabled else 1, dims.tp, split)

    def gathered(self) -> "_Layout":
        """This layout without FSDP2's sharding: a block as its all-gather makes it."""
        whole = replace(self)
        whole.fsdp = 1
        return whole

    def local(self, name: str, tensor: torch.Tensor, bytes_per: int | None = None) -> int:
        """This rank's bytes of `tensor` (FSDP2 pads dim 0 to a multiple of the shard count)."""
        size = bytes_per or tensor.element_size()
        rows = tensor.shape[0] if tensor.ndim else 1
        rest = tensor.numel() // max(rows, 1)
        if name in self.split and name.endswith("lora_A.default.weight"):
            rest //= self.tp  # a row-wise layer's adapter input: split along its columns
        elif name in self.split:
            rows = math.ceil(rows / self.tp)
        return math.ceil(rows / self.fsdp) * rest * size


def run_dtypes(config: Config, device: str, parts: Parts | None = None) -> Dtypes:
    """The trainer's dtypes on `device`: a GPU with bfloat16, or the CPU, where "auto" means no autocast."""
    from vt.shared.runtime import DTYPES

    precision = config.train.mixed_precision
    amp = None if precision == "no" or (device == "cpu" and precision == "auto") else torch.bfloat16
    return (parts or Parts(config)).dtypes(Dtypes(amp, DTYPES[config.model.dtype], config.train.mode))


@dataclass
class _Units:
    """What FSDP2 gathers at once, over the transformers a plan builds: the largest unit (parameters; a full
    fine-tune's gradients in float32) and the root's own parameters, gathered all along."""

    largest: int = 0
    largest_grad: int = 0
    root: int = 0


def make_plan(
    config: Config, gpus: int, device: str = "cuda", stage1: bool = True, budget: int | None = None, lean: bool = False
) -> Plan:
    """Memory per rank of `config` over `gpus` ranks on `device` ("cuda", or "cpu" for host-only runs);
    `stage1=False` leaves out what stage 1's encoding works in (the trainer's own plans need none of it, and
    tracing a large VAE's encode takes minutes); `lean=True` traces only the step the config runs (with or without
    checkpointing, offloaded or not), not the others the printed plan compares. `budget`: the bytes a rank has, against
    which `validation.vae_tiling = "auto"` and `precompute.vae_tiling = "auto"` decide (None: untiled). What each
    training part costs comes from its own memory model (vt.train.parts: `model_memory`, `run_memory`)."""
    spec, parts = spec_for(config), Parts(config)
    dims = ParallelDims.from_config(config.parallel, gpus)
    refusals.check(config, spec, dims.world_size, parts)  # what the trainer refuses, the plan refuses alike
    dtypes = run_dtypes(config, device, parts)
    rank, units, layer = RankPlan(), _Units(), ModelMemory(spec, None, "", None, None, dtypes)
    for key, component in _resident(config, spec).items():
        mode = "frozen" if str(key).startswith("frozen:") else config.train.mode
        _model_memory(config, spec, parts, dims, dtypes, component, mode, rank, units, layer)
    _buffers(config, dims, rank, units, layer.widest)
    if config.parallel.cpu_offload:
        rank.host = rank.weights + rank.gradients + rank.optimizer
        rank.startup = 0  # built and filled in host memory
    sizes = parts.batch_sizes(spec, parse_buckets(config.buckets.sizes))
    micro = {name: max(1, math.ceil(size / dims.dp)) for name, size in sizes.items()}
    plan = Plan(
        config, dims, device, rank, micro_batch=max(micro.values()), micro_batches=micro, dequantized=layer.dequantized
    )
    _traced_step(plan, spec, parts, dtypes, stage1, lean)
    _choose_tiling(plan, spec, budget, stage1)
    parts.run_memory(plan)
    return plan


def _resident(config: Config, spec) -> dict:
    """The transformers a rank holds: the trained one(s), and for validation a one-expert run's other expert."""
    resident = dict(spec.trained_experts or {None: spec.trained_component})
    if config.validation.prompts and spec.experts() and not spec.trains_all_experts:
        for component, _ in spec.experts().values():  # the other expert, frozen, for validation
            if component not in resident.values():
                resident[f"frozen:{component}"] = component
    return resident


def _model_memory(config, spec, parts, dims, dtypes, component, mode, rank, units, layer) -> None:
    """One transformer's weights, gradients and optimizer state on a rank, its FSDP2 units, and what each part adds
    (`layer` carries the widest layer and the dequantized bytes over the transformers)."""
    packed = (
        quantized_base(spec.weights(component), mode, dims.fsdp_enabled or dims.tp > 1, False, component, dtypes.frozen)
        if spec.single_file(component)
        else {}
    )
    options = parts.build_options(spec, trains=mode != "frozen")
    options.pop("host_blocks", None)  # built on the meta device here: where the blocks live is the part's model
    if dims.fsdp_enabled or dims.tp > 1:  # a sharded layout divides the weights itself
        options["quantize"] = "none"
    model = _prepared(
        spec,
        config.model,
        component,
        mode=mode,
        lora=options.pop("lora", None),
        storage_dtype=dtypes.storage(mode),
        sharded=dims.fsdp_enabled,
        compute_dtype=dtypes.compute,
        frozen_dtype=dtypes.frozen,
        packed=packed,
        **options,
    )
    layout = _Layout.of(spec, model, dims)
    memory = ModelMemory(spec, model, mode, layout, rank, dtypes, layer.widest, layer.dequantized)
    _units(config, spec, model, layout, dtypes.param_dtype(mode), units)
    gather = dtypes.param_dtype(mode)
    for name, param in model.named_parameters():
        rank.weights += layout.local(name, param)
        if not param.requires_grad and mode != "frozen":  # the fill reads one tensor at a time into host memory
            rank.fill = max(rank.fill, layout.local(name, param))
        if param.requires_grad:
            rank.gradients += layout.local(name, param, 4)
            rank.optimizer += 2 * layout.local(name, param, 4)  # AdamW's moments
        if dtypes.storage(mode) is not None and gather is None:  # a linear upcast for its matmul
            memory.widest = max(memory.widest, param.numel() * torch.empty((), dtype=dtypes.compute).element_size())
    if mode != "frozen":  # what start-up builds on the device (validation's other expert comes at validation)
        rank.startup += sum(layout.local(name, param) for name, param in model.named_parameters())
    parts.model_memory(memory)
    layer.widest, layer.dequantized = memory.widest, memory.dequantized


def _units(config, spec, model, layout, gather, units: _Units) -> None:
    """FSDP2's units of `model` (a block's large parts, the block, the root's large parts: parallel/fsdp.py), the
    largest gathered one and the root's own parameters, into `units`."""
    names = {id(p): n for n, p in model.named_parameters()}
    split = not config.parallel.compile

    def unit_bytes(params, bytes_per=None) -> int:
        if bytes_per is not None:
            return sum(layout.gathered().local(names[id(p)], p, bytes_per) for p in params if p.requires_grad)
        return sum(_gathered_bytes(names[id(p)], p, layout, gather) for p in params)

    transient = [unit for _, block in spec.named_blocks(model) for unit in (fsdp_units(block) if split else [])]
    transient += [block for _, block in spec.named_blocks(model)]
    transient += [
        child
        for child in model.children()
        if split
        and child not in {getattr(model, n) for n in spec.block_lists}
        and sum(p.numel() for p in child.parameters()) >= ROOT_UNIT
    ]
    counted = set()
    for unit in transient:  # innermost first: each parameter belongs to the first unit that holds it
        params = [p for p in unit.parameters() if id(p) not in counted]
        counted |= {id(p) for p in params}
        units.largest = max(units.largest, unit_bytes(params))
        units.largest_grad = max(units.largest_grad, unit_bytes(params, 4))
    for name, param in model.named_parameters():
        if id(param) not in counted:  # the root's own: gathered all along
            units.root += _gathered_bytes(name, param, layout, gather)


def _buffers(config, dims, rank: RankPlan, units: _Units, widest: int) -> None:
    """Communication and compute buffers: FSDP2's gathered units or DDP's gradient buckets, and the widest layer."""
    if dims.fsdp_enabled:
        # A gathered unit is its unsharded parameters; gathering one also holds the all-gather's output and
        # this rank's copied-in shard until the copy-out: the unit running plus the next one fetched ahead
        # come to (3 + 1/N) units at the peak (measured: docs/memory.md). A full fine-tune's backward adds
        # a unit's unsharded gradients and its reduce-scatter buffers in the reduce dtype (float32).
        shards = dims.dp_shard * dims.cp
        rank.buffers = int((3 + 1 / shards) * units.largest) + units.root
        if config.train.mode == "full":
            rank.buffers += int((2 + 1 / shards) * units.largest_grad)
    elif dims.ddp_enabled:
        rank.buffers = min(100 * 2**20, rank.gradients)
    rank.buffers += widest


def _traced_step(plan: Plan, spec, parts: Parts, dtypes: Dtypes, stage1: bool, lean: bool) -> None:
    """The activations of the run's step (traced once per model, buckets, dtypes and what the parts change of it)."""
    config, dims, device = plan.config, plan.dims, plan.device
    # Under FSDP2 the blocks compute with gathered copies in the param dtype; one process casts its float32
    # weights under autocast (and autocast keeps those casts for the whole forward).
    gathered = dtypes.param_dtype(config.train.mode) if dims.fsdp_enabled else None
    key = (
        config.model.model_dump_json(),
        config.buckets.model_dump_json(),
        config.train.mode,
        parts.trace_key(),
        bool(config.validation.prompts),
        device,
        str(replace(dtypes, fp8_base=False)),  # (the trace holds frozen weights as they compute: fp8 the same)
        str(gathered),
        tuple(sorted(plan.micro_batches.items())),
    )
    kind = parts.activation_kind("checkpointing" if config.parallel.activation_checkpointing else "none", device)
    kinds = frozenset({kind} if lean else {"none", "checkpointing", "offload"})
    traced = _cached(key, stage1, kinds, lean)
    if traced is None:  # alternatives of one config share what the fake runs measured
        _trace(plan, spec, parts, dtypes, gathered, stage1, kinds, largest_only=lean)
        traced = _TRACES[(key, stage1, kinds, not lean)] = (plan.activations, plan.stage1, plan.validation, plan.flops)
    activations, stage1_bytes, validation, flops = traced
    plan.activations, plan.stage1, plan.validation, plan.flops = (
        activations,
        dict(stage1_bytes),
        dict(validation),
        flops,
    )
    worst = max(plan.activations.values(), key=lambda a: a[kind])
    plan.rank.activations = worst[kind] // dims.cp


_PREPARED: dict[tuple, nn.Module] = {}


def _prepared(spec, model_config, component: str, **settings) -> nn.Module:
    """`prepare_transformer`'s meta-device model, built once per model and settings: the alternatives `vt-train plan`
    tries (block swap depths, offload, CP ...) share it, and nothing here changes it. The last few are kept."""
    key = (model_config.model_dump_json(), component, repr(sorted(settings.items(), key=lambda item: item[0])))
    if key not in _PREPARED:
        if len(_PREPARED) >= 4:
            _PREPARED.pop(next(iter(_PREPARED)))
        _PREPARED[key] = prepare_transformer(spec, component, **settings)
    return _PREPARED[key]


def _choose_tiling(plan: Plan, spec, budget: int | None, stage1: bool) -> None:
    """Validation's decode and stage 1's encode, tiled or not as the settings say ("auto": tiled when the
    untiled pass would not fit in `budget`); the tiled passes are traced only when one may be chosen."""
    from vt.shared.vae_tiling import decide

    config, rank = plan.config, plan.rank
    largest = _largest(config)
    tileable = _tileable(spec)
    vae_dtype = run_dtypes(config, plan.device).pipeline_parts
    stage1_dtype = encoder_dtype(torch.device("cuda" if plan.device == "cuda" else "cpu"), spec.frozen_dtype)
    parts = plan.validation
    if parts:
        rank.validation = parts["frozen"] + max(parts["step"], parts["decode"])
        setting = config.validation.vae_tiling
        if tileable and (setting is True or (setting == "auto" and budget is not None)):
            free = None if budget is None else budget - rank.resident - parts["frozen"]  # what the decode may take
            plan.vae_tiled, _ = decide(setting, parts["decode"], free, tileable)
        if plan.vae_tiled:
            parts["decode_tiled"] = _vae_peak(config, spec, largest, "decode", vae_dtype, tiled=True)
            rank.validation = parts["frozen"] + max(parts["step"], parts["decode_tiled"])
        rank.validation_host = parts["frozen"]  # moved to host memory between validations (train/validation.py)
    setting = config.precompute.vae_tiling
    if stage1 and tileable and (setting is True or (setting == "auto" and budget is not None)):
        if setting is True or plan.stage1_peak(tiled=False) > budget:
            plan.stage1["working_tiled"] = _vae_peak(config, spec, largest, "encode", stage1_dtype, tiled=True)


def _tileable(spec) -> bool:
    return spec.vae_tiles


def _largest(config: Config):
    return max(parse_buckets(config.buckets.sizes), key=lambda b: b.frames * b.height * b.width)


_TRACES: dict[tuple, tuple] = {}  # (config key, with stage 1, kinds traced, every bucket) -> what the trace measured


def _cached(key: tuple, stage1: bool, kinds: frozenset, lean: bool) -> tuple | None:
    """A trace of `key` that measured at least what this plan needs."""
    for (other, with_stage1, traced, every_bucket), value in _TRACES.items():
        if other == key and (with_stage1 or not stage1) and traced >= kinds and (every_bucket or lean):
            return value
    return None


def _gathered_bytes(name: str, param: torch.Tensor, layout: _Layout, dtype: torch.dtype | None) -> int:
    """Bytes of one parameter gathered whole by FSDP2 (in the all-gather dtype), still split by TP."""
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else param.element_size()
    return layout.gathered().local(name, param, size)


def _trace(
    plan: Plan,
    spec,
    parts: Parts,
    dtypes: Dtypes,
    gathered: torch.dtype | None,
    stage1: bool = True,
    kinds=frozenset({"none", "checkpointing", "offload"}),
    largest_only: bool = False,
) -> None:
    """Activations per bucket (one micro-batch's forward and backward of each of `kinds`: without checkpointing,
    with it, and with it and activation offload), validation's working memory and stage 1's encoders, all on fake
    tensors."""
    from vt.train.objectives import joint_loss
    from vt.train.parallel import apply_ac

    config, train = plan.config, plan.config.train
    device_type = "cuda" if plan.device == "cuda" else "cpu"
    buckets = parse_buckets(config.buckets.sizes)
    if largest_only:  # the peak's bucket: the most transformer tokens in a micro-batch
        tokens = {b: spec.tokens_per_sample(spec.latent_shape(b)) * plan.micro_for(b.name) for b in buckets}
        buckets = [b for b in buckets if tokens[b] == max(tokens.values())]
    component = next(iter(spec.trained_experts.values()), None) or spec.trained_component
    # Built on the meta device as the trainer builds them (peft's adapters cannot be made on fake tensors),
    # then given fake parameters to run; a narrower storage changes no activation, so frozen weights are
    # held in their compute dtype here (diffusers' casting hooks cannot move fake tensors).
    modules = [
        name
        for name in spec.stage1_components
        if stage1 and isinstance(spec.class_of(name), type) and issubclass(spec.class_of(name), nn.Module)
    ]
    encoders = {
        name: spec.empty_component(name, encoder_dtype(torch.device(device_type), spec.frozen_dtype))
        for name in modules
    }
    vae_dtype = dtypes.pipeline_parts
    frozen = dtypes.compute if dtypes.storage(train.mode) is not None else dtypes.frozen
    amp = dtypes.autocast
    models = {
        checkpointing: prepare_transformer(
            spec,
            component,
            mode=train.mode,
            lora=parts.build_options(spec, trains=True).get("lora"),
            storage_dtype=None,
            sharded=False,
            compute_dtype=dtypes.compute,
            frozen_dtype=frozen,
        )
        for checkpointing, wanted in ((False, "none" in kinds), (True, bool(kinds - {"none"})))
        if wanted
    }
    shapes = {bucket: spec.condition_shapes(bucket) for bucket in buckets}  # the configs' geometry, before faking
    if gathered is not None:
        for model in models.values():
            for param in model.parameters():
                param.data = param.data.to(gathered)  # meta tensors: no memory
    with fake_mode():
        for name, encoder in encoders.items():  # tokenizers and processors hold no weights
            fake_parameters(encoder).eval().requires_grad_(False)
            plan.stage1[name] = sum(p.numel() * p.element_size() for p in encoder.parameters())
        for checkpointing, model in models.items():
            fake_parameters(model)
            for param in model.parameters():  # gradients leave as soon as they exist (FSDP2 frees them per block)
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            if checkpointing:
                apply_ac(model, spec)
            for bucket in buckets:
                batch = _batch(shapes[bucket], plan.micro_for(bucket.name))
                forward = _forward(spec, parts, batch)
                measured = plan.activations.setdefault(bucket.name, {})
                kind = "checkpointing" if checkpointing else "none"
                if kind in kinds:
                    with StepTrace() as step:
                        with _autocast(amp):
                            out = forward(
                                model,
                                batch,
                                torch.full((plan.micro_for(bucket.name),), 0.5),
                                torch.zeros_like(batch["latents"]),
                            )
                        joint_loss(out, config.model.audio_weight)[0].backward()
                    measured[kind] = step.peak
                    plan.flops[kind] = max(plan.flops.get(kind, 0), step.total)  # the largest bucket's
                if checkpointing and "offload" in kinds:  # activation_offload.enabled: saved inputs in host memory
                    offload = _TraceOffload()
                    with StepTrace() as offloaded:
                        with _autocast(amp), offload():
                            out = forward(
                                model,
                                batch,
                                torch.full((plan.micro_for(bucket.name),), 0.5),
                                torch.zeros_like(batch["latents"]),
                            )
                        joint_loss(out, config.model.audio_weight)[0].backward()
                    measured["offload"] = offloaded.peak + offload.largest
                    measured["offload_host"], measured["offload_largest"] = offload.host, offload.largest
                    plan.flops.setdefault("checkpointing", offloaded.total)  # the same step's (lean plans)
        if config.validation.prompts:
            plan.validation = {
                "frozen": _validation_parts(spec, vae_dtype),
                "step": _denoise_bytes(shapes, next(iter(models.values())), spec, amp),
            }
    if config.validation.prompts:  # the decode of one clip of the largest bucket, untiled
        plan.validation["decode"] = _vae_peak(config, spec, _largest(config), "decode", vae_dtype)
    for bucket in buckets if stage1 else ():  # the VAE's working memory while stage 1 encodes a clip of each bucket
        working = _vae_peak(config, spec, bucket, "encode", encoders["vae"].dtype)
        plan.stage1["working"] = max(plan.stage1.get("working", 0), working)


class _TraceOffload(OffloadSaved):
    """activation_offload.enabled in the trace: what would go to host memory is dropped when saved and made
    anew (a fake tensor: device memory again) when backward unpacks it, with a CUDA run's size threshold. `host`: the
    bytes its host arena takes (each tensor once, aligned as the arena lays it out); `largest`: the largest tensor
    sent, of which one more is on the device while its copy back runs ahead of its use."""

    def __init__(self):
        super().__init__(torch.device("cpu"), min_bytes=2**20)
        self.sent: dict[int, tuple] = {}
        self.host = self.largest = 0

    def pack(self, tensor):
        if self._keeps(tensor):
            return tensor
        sent = self.sent.get(id(tensor))
        if sent is None or sent[0]() is not tensor:  # (saved again while alive: one host copy)
            size = tensor.numel() * tensor.element_size()
            self.host += aligned(size)
            self.largest = max(self.largest, size)
            sent = self.sent[id(tensor)] = (weakref.ref(tensor), tensor.shape, tensor.dtype)
        return sent

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        original, shape, dtype = packed
        return original() if original() is not None else torch.zeros(shape, dtype=dtype)


def _forward(spec, parts: Parts, batch: dict[str, torch.Tensor]):
    """The step's forward as the parts wrap the family's (guidance: the base's forward on the empty caption first,
    no gradients, its prediction kept through the step's), its empty caption the batch's first row of conditions."""
    empty = {name: tensor[0] for name, tensor in batch.items() if name not in ("latents", "audio_latents")}
    return parts.forward(spec.forward, RunContext(spec, torch.device("cpu"), empty_caption=lambda: empty))


REAL_CONDITION = 1 << 22  # elements: a condition up to this size is a real tensor in the trace


def _batch(shapes: dict[str, tuple[int, ...]], size: int) -> dict[str, torch.Tensor]:
    """A micro-batch of what stage 1 stores (`spec.condition_shapes`): the latents fake; masks, and conditions
    up to REAL_CONDITION elements (text and image embeddings), real and all ones, so that a family's forward
    branches on their values as on real data (HunyuanVideo 1.5 takes all-zero image embeddings for t2v)."""
    from torch.utils._python_dispatch import _disable_current_modes

    out = {}
    if "audio_latents" in shapes:  # model.audio: the trainer draws noise like them (draw_audio_noise)
        shapes = {**shapes, "audio_noise": shapes["audio_latents"]}
    for name, shape in shapes.items():
        if "mask" in name or (name != "latents" and size * math.prod(shape) <= REAL_CONDITION):
            with _disable_current_modes():
                out[name] = torch.ones(size, *shape)
        else:
            out[name] = torch.zeros(size, *shape)
    return out


def _autocast(amp: torch.dtype | None):
    """The run's autocast on the trace's fake tensors, which live on the CPU whatever the target: CUDA's
    autocast would be disabled there (no CUDA on the planning host), so the trace casts with the CPU's, which
    casts the same matmuls, convolutions and attention to `amp` (and keeps a few more ops in float32)."""
    return torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None)


def _validation_parts(spec, dtype: torch.dtype) -> int:
    """Bytes of what validation loads beside the transformer(s): the pipeline's parts that are modules and neither
    text encoders (their conditions come from the window) nor transformers: the VAE, and where the family's
    pipeline has them text connectors, an audio VAE and a vocoder."""
    skip, declared = set(spec.text_parts()), spec.component_classes()
    total = 0
    for name in spec.pipeline_parts():
        if (
            name in skip
            or name.startswith("transformer")
            or not issubclass(declared.get(name, object), torch.nn.Module)
        ):
            continue  # the scheduler, a guider: no weights
        total += sum(p.numel() * p.element_size() for p in spec.empty_component(name, dtype).parameters())
    return total


def _denoise_bytes(shapes, model, spec, amp) -> int:
    """The most a validation denoising step holds (classifier-free guidance: batch 2, no gradients) for the
    largest bucket."""
    largest = max(shapes, key=lambda b: b.frames * b.height * b.width)
    batch = _batch(shapes[largest], 2)
    with StepTrace(flops=False) as step, torch.no_grad(), _autocast(amp):
        spec.forward(model, batch, torch.full((2,), 0.5), torch.zeros_like(batch["latents"]))
    return step.peak


def _vae_peak(config: Config, spec, bucket, what: str, dtype: torch.dtype, tiled: bool = False) -> int:
    """The VAE's peak while it encodes a clip of `bucket` or decodes one clip's latents, tiled or not, traced
    once per model, bucket and VAE dtype: the training alternatives of a plan share it (HunyuanVideo 1.5's VAE
    builds its attention masks in a Python loop over 49k positions at 480p, minutes on fake tensors). The
    dtype is stage 1's (encode) or validation's (decode)."""
    from vt.shared.vae_tiling import pass_peak

    key = (config.model.model_dump_json(), bucket.name, what, str(dtype), tiled)
    if key not in _VAE_PEAKS:
        vae = spec.empty_component("vae", dtype)
        if what == "encode":
            shape = (1, 3, bucket.frames, bucket.height, bucket.width)
            _VAE_PEAKS[key] = pass_peak(vae, what, shape, tiled, run=spec.vae_mode)
        else:
            shape = (1, *spec.condition_shapes(bucket)["latents"])
            _VAE_PEAKS[key] = pass_peak(vae, what, shape, tiled)
    return _VAE_PEAKS[key]


_VAE_PEAKS: dict[tuple, int] = {}


def dims_one(config: Config) -> bool:
    """A layout block swap takes: no context, tensor or pipeline parallelism, one transformer."""
    parallel = config.parallel
    return parallel.cp == parallel.tp == parallel.pp == 1 and not spec_for(config).trained_experts


def _with(config: Config, section: str, **values) -> Config:
    return config.model_copy(update={section: getattr(config, section).model_copy(update=values)})


def format_plan(plan: Plan, budget_gib: float | None, host_gib: float | None = None) -> str:
    rank, config = plan.rank, plan.config
    where = "GPU" if plan.device == "cuda" else "host"
    decode = plan.validation.get("decode_tiled" if plan.vae_tiled else "decode", 0)
    micro = (
        f"micro-batch {plan.micro_batch} per rank"
        if len(set(plan.micro_batches.values())) <= 1
        else "micro-batches per rank " + ", ".join(f"{name} {n}" for name, n in plan.micro_batches.items())
    )
    lines = [
        f"{config.model.family} {config.train.mode}, {plan.dims.describe()}, {micro}",
        f"per rank ({where}):",
        f"  weights       {rank.weights / GIB:8.2f} GiB",
        f"  optimizer     {rank.optimizer / GIB:8.2f} GiB  (AdamW: two float32 moments"
        f"{'; the EMA: one more' if 'ema' in Parts(config).names() else ''})",
        f"  buffers       {rank.buffers / GIB:8.2f} GiB  (FSDP2 gathered blocks / DDP buckets)",
        "  training phase:",
        f"    gradients   {rank.gradients / GIB:8.2f} GiB  (freed after each optimizer step)",
        f"    activations {rank.activations / GIB:8.2f} GiB  "
        f"(checkpointing {'on' if config.parallel.activation_checkpointing else 'off'}"
        f"{', inputs offloaded to host memory' if rank.offloaded else ''}, largest bucket)",
        "  validation phase:",
        f"    validation  {rank.validation / GIB:8.2f} GiB  (the VAE and the pipeline's other frozen parts, and the "
        f"larger of a denoising step and "
        f"the {'tiled' if plan.vae_tiled else 'untiled'} decode: {decode / GIB:.2f} GiB)",
    ]
    if rank.in_flight:
        lines.append(
            f"    (both phases: {rank.in_flight / GIB:.2f} GiB of swapped block weights in flight, two blocks)"
        )
    lines.append(
        f"  start-up      {rank.startup / GIB:8.2f} GiB  (the model built and filled: what stays on the device)"
    )
    lines.append(
        f"  total         {rank.device_total / GIB:8.2f} GiB on the {where}: the larger of start-up and resident + "
        "the larger phase"
        + (
            f", of {budget_gib:g} GiB: {'fits' if rank.device_total <= budget_gib * GIB else 'does NOT fit'}"
            if budget_gib
            else ""
        )
    )
    if plan.device == "cuda":
        lines += _host_lines(rank, host_gib)
    lines.append("activations per bucket (one micro-batch, before / cp):")
    for bucket, sizes in plan.activations.items():
        lines.append(
            f"  {bucket:<12} "
            + "   ".join(
                f"{name} {sizes[kind] / GIB:8.2f} GiB"
                for kind, name in (
                    ("none", "no checkpointing"),
                    ("checkpointing", "checkpointing"),
                    ("offload", "with offload"),
                )
                if kind in sizes
            )
        )
    encoders = ", ".join(
        f"{name} {size / GIB:.2f}" for name, size in plan.stage1.items() if not name.startswith("working")
    )
    if plan.stage1:
        tiled = "working_tiled" in plan.stage1
        pre = config.precompute
        lines.append(
            f"stage 1, per producer: {encoders} GiB; encoding works in "
            f"{plan.stage1.get('working_tiled' if tiled else 'working', 0) / GIB:.2f} GiB more "
            f"({'tiled' if tiled else 'untiled'}, largest bucket); peak {plan.stage1_peak(tiled) / GIB:.2f} GiB "
            f"(precompute.text_encoder_offload = {pre.text_encoder_offload}"
            + (": the text phase apart)" if pre.text_encoder_offload != "none" else ")")
            + f"; host memory {plan.stage1_host() / GIB:.2f} GiB (text encoders waiting, the decoded clips of "
            f"{pre.text_phase_shards} shard(s) waiting for their text phase and a bucket buffer)"
        )
    return "\n".join(lines)


def _host_lines(rank: RankPlan, host_gib: float | None) -> list[str]:
    """Host memory per rank: what each setting keeps there, and the peak (start-up's arenas and the tensor being read,
    or the steady state's)."""
    parts = [
        (rank.host, "CPU offload: weights, gradients, optimizer"),
        (rank.swapped, "block swap: the swapped blocks' frozen weights, page-locked, exactly their bytes"),
        (rank.offloaded, "activation offload: one micro-step's saved inputs, page-locked"),
        (rank.validation_host, "the validation pipeline's parts between validations"),
        (rank.fill, "start-up: the largest tensor read at once"),
    ]
    lines = ["host memory per rank (beside the process itself, ~3 GiB):"]
    lines += [f"  {size / GIB:8.2f} GiB  {what}" for size, what in parts if size]
    fits = (
        ""
        if host_gib is None
        else f", of {host_gib:g} GiB: {'fits' if rank.host_peak <= host_gib * GIB else 'does NOT fit'}"
    )
    lines.append(f"  peak     {rank.host_peak / GIB:8.2f} GiB{fits}")
    return lines


def plan_json(plan: Plan) -> dict:
    rank = plan.rank
    return {
        "family": plan.config.model.family,
        "mode": plan.config.train.mode,
        "layout": plan.dims.describe(),
        "device": plan.device,
        "micro_batch": plan.micro_batch,
        "micro_batches": plan.micro_batches,
        "per_rank_bytes": {
            "weights": rank.weights,
            "gradients": rank.gradients,
            "optimizer": rank.optimizer,
            "buffers": rank.buffers,
            "activations": rank.activations,
            "validation": rank.validation,
            "host": rank.host,
            "swapped": rank.swapped,
            "in_flight": rank.in_flight,
            "offloaded": rank.offloaded,
            "validation_host": rank.validation_host,
            "startup": rank.startup,
            "fill": rank.fill,
            "resident": rank.resident,
            "total": rank.device_total,
            "host_total": rank.host_total,
            "host_peak": rank.host_peak,
        },
        "validation": plan.validation,
        "validation_vae_tiled": plan.vae_tiled,
        "activations": plan.activations,
        "stage1": plan.stage1,
        "flops": plan.flops,
        **(
            {"stage1_peak": plan.stage1_peak("working_tiled" in plan.stage1), "stage1_host": plan.stage1_host()}
            if plan.stage1
            else {}
        ),
    }


__all__ = ["Plan", "RankPlan", "make_plan", "format_plan", "plan_json"]
