"""How much memory a piece of model code needs, found by running it on fake tensors (no memory, no compute).

Models are built inside a `FakeTensorMode`: every parameter has its real shape and dtype but no storage,
and ops compute only output shapes, so a 14B transformer "runs" on a laptop in seconds. `PeakLive`, a
dispatch mode, records each storage an op creates and drops it once nothing refers to it any more
(a weak reference to the storage itself, so views keep it alive as they keep real memory alive): its
`peak` is the most bytes alive at once, as the caching allocator would need them. This is what
`vt-train plan` uses for activations (a forward and backward) and for the stage-1 encoders' working
memory, from config files alone.

Masks, indices and small conditions have values that matter (a family's forward may drop the tokens a
mask drops, or take all-zero image embeddings for text-to-video): `KnownValues` runs an op for real when
every tensor it reads is real and what it makes is small, so code that branches on their contents runs
as it would, while everything the weights touch, and any large product of real inputs, stays fake.

The plan's step trace needs all three (and `FlopCount`, the step's FLOPs) over the same ops: `StepTrace` does their
three jobs in one mode, so each of the ~10^5 ops of a 14B step passes one Python dispatch mode above the fake one,
not three.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def fake_mode():
    """A FakeTensorMode in which real (CPU) tensors may mix with fake ones (masks, token ids)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every meta parameter of `model` by a fake CPU tensor of the same shape, dtype and
    requires_grad, in place (call it inside the fake mode): a model built as the trainer builds it, made runnable."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad
                )
    return model


def _flop_formulas() -> dict:
    """op packet -> FLOPs of one call: torch.utils.flop_counter's registry, and its attention formulas for the CPU's
    flash kernel (which the fake trace runs)."""
    from torch.utils import flop_counter

    formulas = dict(flop_counter.flop_registry)
    aten = torch.ops.aten
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = (
        lambda query, key, value, *args, out_val=None, **kwargs: flop_counter.sdpa_flop_count(
            query.shape, key.shape, value.shape
        )
    )
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
        lambda grad_out, query, key, value, *args, out_val=None, **kwargs: flop_counter.sdpa_backward_flop_count(
            grad_out.shape, query.shape, key.shape, value.shape
        )
    )
    return formulas


class FlopCount(TorchDispatchMode):
    """FLOPs of the matmuls, convolutions and attentions run while the mode is on (`total`), by torch's own formulas
    (torch.utils.flop_counter's registry, and its attention formulas for the CPU's flash kernel, which the fake
    trace runs). Unlike FlopCounterMode it never decomposes an op it has no formula for, so the ops that run, and
    the memory a `PeakLive` beside it counts, are the same as without it."""

    def __init__(self):
        super().__init__()
        self.formulas = _flop_formulas()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total += _flops(self.formulas, func, args, kwargs, out)
        return out


def _flops(formulas: dict, func, args, kwargs, out) -> int:
    """`func`'s FLOPs by its formula in `formulas` (0 for an op with none)."""
    formula = formulas.get(func._overloadpacket)
    return 0 if formula is None else int(formula(*args, **kwargs, out_val=out))


class PeakLive(TorchDispatchMode):
    """Bytes of the storages ops create while the mode is on: `live` now, `peak` at most, over one region. A storage
    counts until it is freed: a weak reference's callback (a storage keeps its Python object while any tensor uses
    it, so the callback comes when the last view goes), so no op pays for a sweep over what is alive."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # An output on an input's storage (a view, an in-place op) allocated nothing: the weights a
        # `weight.t()` reads were there before the region and are no activation.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        self._count(out, inputs)
        return out

    def _count(self, out, inputs: set[int]) -> None:
        """Track the storages of `out` that are new (on none of the op's `inputs`), and the peak."""
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in self.storages and key not in inputs:
                self._track(storage, key, storage.nbytes())
        self.peak = max(self.peak, self.live)

    def _track(self, storage, key: int, size: int) -> None:
        def freed(_, key=key, size=size):
            if self.storages.pop(key, None) is not None:
                self.live -= size

        self.storages[key] = weakref.ref(storage, freed)
        self.live += size

    def current(self) -> int:
        """Bytes alive now."""
        return self.live


def _tensors(value) -> list:
    """The tensors in an op's arguments or outputs (tensors, and lists and tuples of them: all an aten op takes or
    returns), in order: what `tree_leaves` finds there, without its per-node registry lookups."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        found = []
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple, dict)):
                found += _tensors(item)
        return found
    if isinstance(value, dict):
        return _tensors(tuple(value.values()))
    return []


SMALL = 1 << 20  # elements: a constant a mask or an index is made of, not an activation
KNOWN_OUTPUT = 1 << 24  # elements: the most an op on real inputs may make and still run for real


class KnownValues(TorchDispatchMode):
    """Run an op on real tensors when all its tensor inputs are real and its outputs small, or when it makes a small
    constant tensor (zeros, ones, full: e.g. a family's empty image tokens); enter it inside the fake mode.
    Their values stay known, so data-dependent code (nonzero, item, `if torch.all(x == 0)`) works."""

    CONSTANTS = (torch.ops.aten.zeros.default, torch.ops.aten.ones.default, torch.ops.aten.full.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return _run_known(func, args, kwargs, [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])


_CONSTANTS = KnownValues.CONSTANTS


def _run_known(func, args, kwargs, tensors: list):
    """`func` as KnownValues runs it (inside the fake mode): for real on known values, else on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    known = (
        all(not isinstance(t, FakeTensor) for t in tensors) and _small_result(func, args, kwargs)
        if tensors
        else func in _CONSTANTS and math.prod(args[0]) <= SMALL
    )
    # (real inputs with a large output, a mask's outer product at 50k tokens, make an activation: fake)
    if known:
        with _disable_current_modes():
            return func(*args, **kwargs)
    if func is torch.ops.aten.index.Tensor and any(_known_mask(i) for i in args[1]):
        # `x[mask]` with a known mask: the same as indexing by the mask's positions, whose count is known.
        with _disable_current_modes():
            positions = [i.nonzero(as_tuple=True) if _known_mask(i) else (i,) for i in args[1]]
        return func(args[0], [p for group in positions for p in group], *args[2:], **kwargs)
    return func(*args, **kwargs)


class StepTrace(PeakLive):
    """`KnownValues`, `PeakLive` and (with `flops`) `FlopCount` as one mode, each op seen once: what the three stacked
    (KnownValues innermost, FlopCount on top) measure, in a third of the Python dispatch (a Wan 14B step is ~10^5
    ops). `peak`, `live` and `total` as theirs; enter it inside the fake mode."""

    def __init__(self, flops: bool = True):
        super().__init__()
        self.formulas = _flop_formulas() if flops else {}
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args) + _tensors(tuple(kwargs.values())) if kwargs else _tensors(args)
        inputs = {t.untyped_storage()._cdata for t in tensors}
        out = _run_known(func, args, kwargs, tensors)
        self._count(out, inputs)
        self.total += _flops(self.formulas, func, args, kwargs, out)
        return out


def _small_result(func, args, kwargs) -> bool:
    """Whether `func`'s outputs on these real inputs have at most KNOWN_OUTPUT elements, found on meta copies (no
    compute); an op whose output size depends on the values (nonzero, masked_select) counts as small."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_map

    def meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    with _disable_current_modes():
        try:
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        except Exception:  # no meta kernel, or a value-dependent one: run it for real, as a small op
            return True
    return all(t.numel() <= KNOWN_OUTPUT for t in tree_leaves(out) if isinstance(t, torch.Tensor))


def _known_mask(index) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor) and index.dtype == torch.bool


@contextlib.contextmanager
def peak_bytes():
    """`with peak_bytes() as tracker:` ... `tracker.peak`: the most bytes the code in the block held at once
    beyond what existed before it (run it inside the fake mode the model lives in)."""
    tracker = PeakLive()
    with tracker:
        yield tracker
