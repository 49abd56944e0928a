"""Which tensors of a single-file checkpoint diffusers' single-file mapping renames and which it computes.

diffusers maps an original checkpoint's keys to its own with a `checkpoint_mapping_fn` per model class; vt runs it
once on meta tensors of the file's shapes while `Lineage`, a torch-function mode, records which file tensors each
result comes from: a result that is one of its inputs untouched is renamed (read lazily, block by block); any other
belongs to the group of file tensors it was computed from (computed for real when first read). See single_file.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from vt.shared.errors import UserError


def mapping_function(cls: type) -> Callable | None:
    """diffusers' `checkpoint_mapping_fn` for a model class (its own entry, else a base class's), or None."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES as classes

    entry = classes.get(cls.__name__) or next(
        (
            e
            for name, e in classes.items()
            if isinstance(getattr(diffusers, name, None), type) and issubclass(cls, getattr(diffusers, name))
        ),
        None,
    )
    return entry["checkpoint_mapping_fn"] if entry else None


class Lineage(TorchFunctionMode):
    """Records, for every tensor the torch functions inside it make, the file keys it was computed from."""

    def __init__(self, sources: dict[int, frozenset[str]]):
        super().__init__()
        self.of = dict(sources)
        self.modified: set[int] = set()
        self._keep: list[torch.Tensor] = []  # so no id is reused while tracing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        found = frozenset().union(*(self.of.get(id(t), frozenset()) for t in inputs))
        name = getattr(func, "__name__", "")
        if inputs and (name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
            self.modified.add(id(inputs[0]))  # an in-place op: the tensor is no longer what the file holds
            self.of[id(inputs[0])] = found
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in self.of:
                self.of[id(tensor)] = found
                self._keep.append(tensor)
        return out


def trace_mapping(inputs: dict[str, torch.Tensor], run_mapping: Callable[[dict], dict], what: str):
    """(renamed: diffusers name -> (file key, shape), computed: name -> (group, shape, file keys), groups: group ->
    file keys) of `run_mapping` over `inputs` (file key -> meta tensor); `what` names the mapping in errors."""
    ids = {id(t): name for name, t in inputs.items()}
    mode = Lineage({id(t): frozenset([name]) for name, t in inputs.items()})
    with mode:
        out = run_mapping(dict(inputs))
    renamed, lineage = {}, {}
    for name, tensor in out.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        source = ids.get(id(tensor))
        if source is not None and id(tensor) not in mode.modified:
            renamed[name] = (source, tuple(tensor.shape))
        elif mode.of.get(id(tensor)):
            lineage[name] = (mode.of[id(tensor)], tuple(tensor.shape))
        else:
            raise UserError(f"diffusers' {what} made {name} from no tensor of the file")
    del mode  # the trace's intermediates
    root: dict[str, str] = {}  # union-find over the file keys that computed tensors share

    def find(key: str) -> str:
        while root.setdefault(key, key) != key:
            key = root[key]
        return key

    for sources, _ in lineage.values():
        first, *rest = sorted(sources)
        for other in rest:
            root[find(other)] = find(first)
    group_ids: dict[str, int] = {}
    groups: dict[int, set[str]] = {}
    computed = {}
    for name, (sources, shape) in lineage.items():
        group = group_ids.setdefault(find(next(iter(sources))), len(group_ids))
        groups.setdefault(group, set()).update(sources)
        computed[name] = (group, shape, sources)
    return renamed, computed, groups
