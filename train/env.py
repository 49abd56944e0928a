"""`vt-train env`: one block describing this machine, to paste into a bug report.

Versions of vt and the libraries it trains with (torch, diffusers, transformers, peft, accelerate,
torchao, PyAV and the FFmpeg libraries PyAV was built with), the CUDA, cuDNN and NCCL torch uses,
the GPUs, and what this machine can run: the attention backends (vt.train.attention, for training
and for inference only) and the fp8 training recipes (vt.train.fp8). Nothing here loads a model.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from vt.train.attention import available_backends
from vt.train.fp8 import FP8_RECIPES, fp8_training_support

__all__ = ["environment", "format_environment"]
PACKAGES = (
    "vt",
    "torch",
    "diffusers",
    "transformers",
    "peft",
    "accelerate",
    "torchao",
    "av",
    "flash-attn",
    "xformers",
    "sageattention",
)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _ffmpeg() -> str:
    """The FFmpeg library versions PyAV was built against (e.g. libavcodec 61.19.100)."""
    try:
        import av
    except ImportError:
        return "PyAV not installed"
    versions = getattr(av, "library_versions", {})
    libraries = ", ".join(f"{name} {'.'.join(map(str, version))}" for name, version in sorted(versions.items()))
    return f"FFmpeg {getattr(av, 'ffmpeg_version_info', 'unknown')} ({libraries or 'library versions unknown'})"


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append(f"cuda:{index} {props.name}, sm{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB")
    return out


def environment() -> dict[str, object]:
    """What `vt-train env` prints, as a mapping (name -> text or list of texts)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    info: dict[str, object] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
    }
    info.update({package: _version(package) for package in PACKAGES})
    info["ffmpeg (PyAV)"] = _ffmpeg()
    info["cuda (torch)"] = torch.version.cuda or "none (CPU build)"
    info["cudnn"] = str(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else "none"
    nccl = torch.cuda.nccl.version() if cuda and torch.distributed.is_nccl_available() else None
    info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl or "none")
    info["gpus"] = _gpus() or ["none (CPU only)"]
    info[f"attention backends, training ({device})"] = available_backends(device, training=True)
    info[f"attention backends, inference ({device})"] = available_backends(device, training=False)
    why = fp8_training_support(device)
    info["fp8 training recipes"] = list(FP8_RECIPES) if why is None else [f"none: {why}"]
    return info


def format_environment(info: dict[str, object]) -> str:
    """One aligned `name: value` line per entry, lists joined with commas."""
    width = max(map(len, info))
    lines = [
        f"{name + ':':<{width + 1}} {', '.join(map(str, value)) if isinstance(value, list) else value}"
        for name, value in info.items()
    ]
    return "\n".join(lines)
