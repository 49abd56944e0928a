"""Which attention kernel the transformer runs: a config name -> diffusers' attention dispatcher.

diffusers routes every attention of its transformers through `dispatch_attention_fn`, and
`ModelMixin.set_attention_backend(name)` points each attention processor at one kernel. vt only
chooses the name (`train.attention_backend`, and `validation.attention_backend` for the
validation videos) and checks at start-up that this machine can run it, so a run never fails at its
first step, or silently falls back, because a package or GPU feature is missing. No kernel is
patched: a processor that does not go through the dispatcher keeps its own attention, and the log
says how many attention modules took the backend.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from vt.shared.errors import UserError
from vt.shared.log import get_logger

__all__ = ["BACKENDS", "available_backends", "check_backend", "set_backend", "backend_for"]
log = get_logger("vt.train.attention")


@dataclass(frozen=True)
class Backend:
    diffusers_name: str  # the name in diffusers.models.attention_dispatch.AttentionBackendName
    needs: str  # what it needs, for the error message
    cuda_only: bool = False
    min_capability: tuple[int, int] = (0, 0)  # CUDA compute capability
    package: str = ""  # an importable module it needs
    trains: bool = True  # False: forward only (its backward raises)
    trains_on_cpu: bool = True  # False: its backward needs a GPU


BACKENDS: dict[str, Backend] = {
    "native": Backend("native", "nothing (torch SDPA chooses the kernel)"),
    "native_math": Backend("_native_math", "nothing (torch SDPA's reference math kernel)"),
    "native_cudnn": Backend("_native_cudnn", "a CUDA GPU with cuDNN attention (sm80+)", True, (8, 0)),
    "native_flash": Backend("_native_flash", "a CUDA GPU of sm80+ (torch's built-in FlashAttention-2)", True, (8, 0)),
    "native_efficient": Backend("_native_efficient", "a CUDA GPU (torch's memory-efficient kernel)", True),
    "flash": Backend("flash", "a CUDA GPU of sm80+ and the flash-attn package", True, (8, 0), "flash_attn"),
    "flex": Backend("flex", "torch >= 2.5 (FlexAttention; training needs a GPU: no CPU backward)", trains_on_cpu=False),
    "xformers": Backend("xformers", "a CUDA GPU and the xformers package", True, package="xformers"),
    "sage": Backend(
        "sage", "a CUDA GPU and the sageattention package; inference only", True, (8, 0), "sageattention", trains=False
    ),
}


def _missing(name: str, device: torch.device, training: bool = True) -> str | None:
    """Why `name` cannot run on `device` here (for training, or inference only), or None when it can."""
    backend = BACKENDS[name]
    if training and device.type == "cpu" and not backend.trains_on_cpu:
        return f"needs {backend.needs}; this run is on the CPU"
    if backend.cuda_only:
        if device.type != "cuda":
            return f"needs {backend.needs}; this run is on {device}"
        if torch.cuda.get_device_capability(device) < backend.min_capability:
            return f"needs {backend.needs}; {torch.cuda.get_device_name(device)} is sm" + "".join(
                map(str, torch.cuda.get_device_capability(device))
            )
    if backend.package and importlib.util.find_spec(backend.package) is None:
        return f"needs {backend.needs}; {backend.package} is not installed"
    from diffusers.models import attention_dispatch

    try:  # diffusers' own check: package versions, torch version
        attention_dispatch._check_attention_backend_requirements(
            attention_dispatch.AttentionBackendName(backend.diffusers_name)
        )
    except RuntimeError as err:
        return str(err)
    return None


def available_backends(device: torch.device, training: bool = True) -> list[str]:
    """The backend names this machine can run on `device` (for training, or for inference only)."""
    return [
        name
        for name, backend in BACKENDS.items()
        if (backend.trains or not training) and _missing(name, device, training) is None
    ]


def check_backend(name: str, device: torch.device, training: bool = True, key: str = "train.attention_backend") -> None:
    """Stop with a message naming what this machine has when `name` cannot run here."""
    if name not in BACKENDS:
        raise UserError(f"{key} = {name!r}: unknown; choose one of {sorted(BACKENDS)}")
    if training and not BACKENDS[name].trains:
        raise UserError(
            f"{key} = {name!r}: its kernel has no backward, so it can only be used for validation "
            f"(validation.attention_backend)"
        )
    why = _missing(name, device, training)
    if why is not None:
        raise UserError(
            f"{key} = {name!r} cannot run here: {why}. This machine can run: "
            f"{', '.join(available_backends(device, training))}"
        )


def set_backend(model: nn.Module, name: str) -> int:
    """Point every dispatcher-aware attention of `model` (a diffusers model, or a container of them,
    e.g. several experts) at backend `name`; returns how many attention modules took it."""
    models = (
        [model]
        if hasattr(model, "set_attention_backend")
        else [m for m in model.children() if hasattr(m, "set_attention_backend")]
    )
    if not models:
        raise TypeError(f"{type(model).__name__} is not a diffusers model; it has no attention dispatcher")
    for each in models:
        each.set_attention_backend(BACKENDS[name].diffusers_name)
    taken = sum(
        1
        for module in model.modules()
        if getattr(getattr(module, "processor", None), "_attention_backend", None) is not None
    )
    if taken == 0 and name != "native":
        log.warning(
            "attention backend %s does nothing here: %s's attention processors do not go through "
            "diffusers' dispatcher, so they keep their own attention",
            name,
            type(models[0]).__name__,
        )
    return taken


@contextlib.contextmanager
def backend_for(model: nn.Module, name: str, restore: str):
    """Run a block with `model` on backend `name` (e.g. validation's), then put `restore` back."""
    if name == restore:
        yield
        return
    modules = set_backend(model, name)
    log.info("attention backend %s for this block (%d attention modules), then %s again", name, modules, restore)
    try:
        yield
    finally:
        set_backend(model, restore)
