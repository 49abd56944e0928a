"""A GPU that counts bytes: what the trainer's real start-up and step need on a GPU and in host memory, on a CPU.

This machine has no GPU, and on a CPU the trainer's "device" copies are host memory like everything else, so a CPU
run cannot show what a GPU run holds where. The stand-in:

- a device of its own: torch's PrivateUse1 backend set up from Python (`torch.utils.backend_registration`), as
  `DEVICE`, with CUDA's autocast policy registered for it (matmuls, convolutions and attention cast to the autocast
  dtype; norms, softmax, losses and reductions in float32; mixed inputs of `cat`-like ops promoted), so a step under
  `torch.autocast(DEVICE.type, bf16)` makes the activations a CUDA step makes;
- fake tensors (FakeTensorMode): every tensor, on the device or in host memory, has its shape, dtype and device but
  no storage, so a 14B model starts and steps in seconds with no memory;
- `DeviceBytes`, a dispatch mode that counts each storage ops create, per device (the stand-in GPU, "cpu" for host
  memory), until nothing refers to it: `peak` per device, as the allocators would need it. Host memory pinned
  through torch's caching host allocator (`pin_memory=True`) counts at the power of two that allocator rounds it to;
- `FakeWeights`: a component's checkpoint as a table of names and shapes (optionally its linear layers quantized as a
  GGUF or `frozen_base.quantize` file stores them), read as fake host tensors.

The trainer runs unchanged on `DEVICE`: it has no CUDA streams there (vt's SideStream runs copies in order off CUDA),
which move no memory; everything else, where each tensor is made and copied, is the GPU path.
"""

from __future__ import annotations

import contextlib
import gc
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from vt.shared.memory_trace import _tensors

NAME = "standin"  # the PrivateUse1 backend renamed (torch counts a renamed one as the accelerator)
_installed = False

# CUDA's autocast lists (torch/csrc/autograd/autocast_mode.cpp, the ops that exist as aten overloads here)
LOWER = (
    "linear",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "addbmm",
    "addmv",
    "addr",
    "mv",
    "einsum",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "_convolution",
    "prelu",
    "scaled_dot_product_attention",
    "chain_matmul",
    "linalg_vecdot",
)
FLOAT32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "prod",
    "cumprod",
    "cumsum",
    "sum",
    "softmax",
    "log_softmax",
    "norm",
    "rms_norm",
)
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "grid_sampler",
    "index_put",
    "scatter_add",
    "tensordot",
    "cat",
    "stack",
)


DEVICE = torch.device("privateuseone", 0)  # printed as NAME:0 once installed


class _Backend:
    """What torch asks of a backend module (autocast, RNG, device count)."""

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def get_amp_supported_dtype(self):
        return [torch.bfloat16, torch.float16]

    def is_bf16_supported(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass


def install() -> None:
    """Set the stand-in device up in this process (once; it stays for the process's life)."""
    global _installed
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=NAME, backend_module=_Backend())
    _register_autocast()
    _attention_as_cuda()
    _installed = True


def _register_autocast() -> None:
    key = "AutocastPrivateUse1"
    library = torch.library.Library("aten", "IMPL")
    everything = torch.library.Library("_", "IMPL")
    _register_autocast.libraries = (library, everything)  # kept alive: the registrations go with them
    everything.fallback(torch.library.fallthrough_kernel, key)
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(op, cast):
        def run(*args, **kwargs):
            target = cast(args, kwargs)
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                if target is None:
                    return op(*args, **kwargs)
                convert = lambda t: (
                    t.to(target)
                    if isinstance(t, torch.Tensor)
                    and t.is_floating_point()
                    and t.device.type == DEVICE.type
                    and t.dtype != torch.float64
                    else t
                )
                return op(*tree_map(convert, args), **tree_map(convert, kwargs))

        return run

    def lower(args, kwargs):
        return torch.get_autocast_dtype(DEVICE.type)

    def float32(args, kwargs):
        return torch.float32

    def promote(args, kwargs):
        dtypes = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()}
        return torch.float32 if len(dtypes) > 1 and torch.float32 in dtypes else None

    for names, cast in ((LOWER, lower), (FLOAT32, float32), (PROMOTE, promote)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                try:
                    library.impl(
                        op._schema.name.split("::")[1] + ("." + overload if overload != "default" else ""),
                        kernel(op, cast),
                        key,
                    )
                except RuntimeError:  # an overload with a kernel of its own for this key already
                    continue


def _attention_as_cuda() -> None:
    """`F.scaled_dot_product_attention` on the stand-in runs CUDA's fused kernels (flash attention, or the memory-
    efficient one with a mask), which torch chooses per device in C++ and has no choice for a Python backend: without
    this it would take the math kernel, which holds the whole score matrix (hundreds of GiB at 480p)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != DEVICE.type or enable_gqa:
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if torch.is_autocast_enabled(DEVICE.type):
            dtype = torch.get_autocast_dtype(DEVICE.type)
            query, key, value = (t.to(dtype) for t in (query, key, value))
            attn_mask = attn_mask.to(dtype) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        if attn_mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf")
            )
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query,
            key,
            value,
            attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2]),
            True,
            dropout_p,
            is_causal,
            scale=scale,
        )[0]

    torch.nn.functional.scaled_dot_product_attention = attention


def pinned_size(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned block of `nbytes`: the next power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes else 0


def _real(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, torch.Tensor) and not isinstance(tensor, FakeTensor)


def _outputs(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


KNOWN = 1 << 16  # elements: the most a tensor whose values are kept may have (masks, lengths)
_SCALAR = torch.ops.aten._local_scalar_dense.default
_NOT_KNOWN = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
_FILLS = (torch.ops.aten.zeros.default, torch.ops.aten.ones.default, torch.ops.aten.full.default)
_ALIASING: dict = {}


def _aliasing(func) -> set[int]:
    """The positions of `func`'s outputs that alias an input (views, in-place and out= ops), from its schema."""
    if func not in _ALIASING:
        _ALIASING[func] = {i for i, r in enumerate(func._schema.returns) if r.alias_info is not None}
    return _ALIASING[func]


class DeviceBytes(TorchDispatchMode):
    """Bytes of the storages ops create while the mode is on, per device type: `live`, and `peak` since the last
    `start_phase`. Meta tensors hold nothing and are not counted."""

    def __init__(self, fake_mode=None):
        super().__init__()
        self.fake_mode = fake_mode  # a real host constant copied to the device becomes one of its fake tensors
        self.storages: dict[int, weakref.ref] = {}
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        # Small real tensors (masks, token counts) copied to the device keep their values beside the fake copy, and
        # so does whatever small ops make from them alone: code that reads a mask's values (`tolist`) reads these,
        # as a GPU would hand them back.
        self.values = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        known = self._known_values(func, args, kwargs)
        if func is _SCALAR and known is not None:
            return known
        if (
            func is torch.ops.aten._to_copy.default
            and self.fake_mode is not None
            and _real(args[0])
            and kwargs.get("device") is not None
            and kwargs["device"].type == DEVICE.type
        ):
            args = (self.fake_mode.from_tensor(args[0]), *args[1:])  # (a real tensor cannot be on the stand-in)
        out = func(*args, **kwargs)
        if known is not None:
            for made, value in zip(_outputs(out), _outputs(known)):
                if isinstance(made, torch.Tensor) and isinstance(value, torch.Tensor) and made.shape == value.shape:
                    self.values[made] = value
        aliased = _aliasing(func)
        pinned = bool(kwargs.get("pin_memory")) or func is torch.ops.aten._pin_memory.default
        for index, tensor in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            # An output on an input's storage (a view, an in-place op: its schema says so) allocated nothing.
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or index in aliased:
                continue
            storage = tensor.untyped_storage()
            if storage._cdata in self.storages:
                continue
            size = pinned_size(storage.nbytes()) if pinned else storage.nbytes()
            where = tensor.device.type
            self._track(storage, size, where)
            self.peak[where] = max(self.peak.get(where, 0), self.live[where])
        return out

    def _known_values(self, func, args, kwargs):
        """The real result of `func` on the known values of its inputs, when every tensor input is real or known and
        they and it are small (None otherwise): factories of small constants too."""
        from torch.utils._python_dispatch import _disable_current_modes

        tensors = _tensors(args) + _tensors(tuple(kwargs.values())) if kwargs else _tensors(args)
        if func in _NOT_KNOWN or sum(t.numel() for t in tensors) > KNOWN:
            return None
        if func in _FILLS and math.prod(args[0]) > KNOWN:  # a large constant: made fake, never computed for real
            return None
        if not all(_real(t) or t in self.values for t in tensors):
            return None

        def real(value):
            if isinstance(value, torch.Tensor):
                return value if _real(value) else self.values[value]
            return torch.device("cpu") if isinstance(value, torch.device) else value

        with _disable_current_modes():
            try:
                out = func(*tree_map(real, args), **tree_map(real, kwargs))
            except Exception:  # an op the host cannot run on these: its values stay unknown
                return None
        small = all(t.numel() <= KNOWN for t in _outputs(out) if isinstance(t, torch.Tensor))
        return out if small or func is _SCALAR else None

    def _track(self, storage, size: int, where: str) -> None:
        """Count `storage` as alive on `where` until it is freed (a weak reference's callback: storages keep their
        Python object while any tensor uses them, so the callback comes when the last view goes)."""
        key = storage._cdata

        def freed(_, key=key, size=size, where=where):
            if self.storages.pop(key, None) is not None:
                self.live[where] -= size

        self.storages[key] = weakref.ref(storage, freed)
        self.live[where] = self.live.get(where, 0) + size

    def start_phase(self) -> dict[str, int]:
        """The peaks so far; from now on the peaks start from what is alive."""
        peaks = dict(self.peak)
        self.peak = dict(self.live)
        return peaks

    def current(self) -> dict[str, int]:
        return dict(self.live)


class FakeWeights:
    """A component's checkpoint as the trainer reads it (shared/weights: names, shapes, read by blocks), its tensors
    fake host tensors: the names and shapes of `model` (the component built on the meta device), stored in `dtype`.
    `quantized`: module name -> Packing for the linear layers a quantized file stores so (read_packed, scale)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, quantized: dict | None = None):
        self.tensors = {
            name: (tuple(t.shape), t.dtype if t.dtype == torch.float32 else dtype)
            for name, t in model.state_dict(keep_vars=True).items()
        }
        self.quantized = quantized or {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][0]

    def scaled_modules(self) -> set[str]:
        return set()

    def quantized_modules(self) -> dict:
        return self.quantized

    def read(self, name, offsets=None, shape=None) -> torch.Tensor:
        return torch.empty(shape or self.shape(name), dtype=self.tensors[name][1])

    def read_packed(self, name, offsets=None, shape=None) -> torch.Tensor:
        packing = self.quantized[name.removesuffix(".weight")]
        rows = self.shape(name)[0]
        return torch.empty(rows, packing.row_bytes, dtype=torch.int8 if packing.kind == "int8" else torch.uint8)

    def scale(self, name: str):
        packing = self.quantized.get(name.removesuffix(".weight"))
        if packing is None or packing.scale is None:
            return None
        return torch.empty(packing.scale, dtype=torch.float32)

    def read_scaled(self, name, offsets=None, shape=None) -> torch.Tensor:
        return self.read(name, offsets, shape)


def gib(nbytes: int) -> float:
    return nbytes / 2**30


def close(a: int, b: int, tolerance: float) -> bool:
    return math.isclose(a, b, rel_tol=tolerance)


def linear_packings(model: torch.nn.Module, qtype: int) -> dict:
    """module name -> Packing of every Linear of `model` whose rows are whole `qtype` blocks (ggml's), as a GGUF
    file quantized to `qtype` stores it (ComfyUI-GGUF's convert quantizes every such 2-D weight)."""
    from vt.shared.weights.gguf_quants import BLOCK_SIZES, row_bytes
    from vt.shared.weights.packing import Packing

    values = BLOCK_SIZES[qtype][0]
    return {
        name: Packing(qtype, row_bytes(qtype, module.in_features))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module.in_features % values == 0
    }


@contextlib.contextmanager
def standin_components(weights: FakeWeights, single_file: str | None = None):
    """The family specs read the transformer's weights from `weights` (and, with `single_file`, take it for a
    single-file transformer of that name, as a GGUF one), for the trainer and the plan alike."""
    from vt.shared.models.components import ComponentLoader

    real_weights, real_single = ComponentLoader.weights, ComponentLoader.single_file

    def fake_weights(self, name):
        return weights if name.startswith("transformer") else real_weights(self, name)

    def fake_single(self, name):
        return single_file if single_file and name.startswith("transformer") else real_single(self, name)

    ComponentLoader.weights, ComponentLoader.single_file = fake_weights, fake_single
    try:
        yield
    finally:
        ComponentLoader.weights, ComponentLoader.single_file = real_weights, real_single


def trace_trainer(config, batch_tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, int]]:
    """The trainer's real start-up and a steady training step of `config` (whose train.device is the stand-in), on
    fake tensors: {"startup": peak bytes per device while `Trainer(config)` builds and fills the model, "step": ...
    over a step with the optimizer's state in place, as every step after the first}. The step trains one batch of
    `batch_tensors` (one sample's stage-1 tensors, host memory). Patches the family's weights first
    (`standin_components`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vt.shared import host_memory
    from vt.shared.weights import quantize
    from vt.train import model_build
    from vt.train import trainer as trainer_module
    from vt.train.data import Batch

    install()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    modes = [fake, DeviceBytes(fake)]
    real_materialize, real_stop = model_build.materialize, trainer_module.stop_if_not_finite
    entered = []

    def materialize(*args, **kwargs):  # the model is built on the meta device for real; from here on, fake tensors
        if not entered:
            for mode in modes:
                mode.__enter__()
                entered.append(mode)
        return real_materialize(*args, **kwargs)

    model_build.materialize = materialize
    trainer_module.stop_if_not_finite = lambda *args: None  # a fake loss has no value to check
    # Host copies for the stand-in are page-locked as for CUDA (counted by vt.shared.host_memory.pinned_bytes);
    # the driver's registration itself is all that is left out.
    real_pins, real_register, real_unregister = host_memory.pins, host_memory._register, host_memory._unregister
    host_memory.pins = lambda device: device.type in ("cuda", NAME)
    host_memory._register = host_memory._unregister = lambda tensor: None
    try:
        trainer = trainer_module.Trainer(config)
        counted = modes[1]
        startup = counted.start_phase()
        for group in trainer.optimizer.param_groups:
            group["capturable"] = True  # AdamW without host reads of its step count (fake tensors have no values)
        for param in trainer.params:  # the optimizer's state made as the first step makes it
            param.grad = torch.zeros_like(param)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        counted.start_phase()
        bucket = config.buckets.sizes[0]
        tensors = {name: tensor.unsqueeze(0) for name, tensor in batch_tensors.items()}
        trainer.train_step([Batch(bucket=bucket, epoch=0, keys=["standin"], tensors=tensors)])
        step = counted.start_phase()
        pinned = host_memory.pinned_bytes()
        del trainer
        gc.collect()  # its arenas unlocked (with the stand-in's registration) and freed here, before the patches go
        return {"startup": startup, "step": step, "pinned": pinned}
    finally:
        for mode in reversed(entered):
            mode.__exit__(None, None, None)
        model_build.materialize, trainer_module.stop_if_not_finite = real_materialize, real_stop
        host_memory.pins, host_memory._register, host_memory._unregister = real_pins, real_register, real_unregister
        quantize._PAIRS_ON.pop(DEVICE, None)  # a fake tensor of this run's mode: no later run may use it
