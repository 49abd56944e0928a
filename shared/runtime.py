"""Where this process runs and how it draws: rank, device, dtypes by name, keyed random generators.

One place for what both stages ask of the process. Ranks come from torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE), or from torch.distributed once a process group exists. Keyed generators
turn a tuple of names and numbers into a seeded `torch.Generator`, so randomness is a function of
where it is used (seed, step, sample), never of how much was drawn before: a resumed run, any
parallel layout and any accumulation setting draw the same numbers.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rank() -> int:
    """This process's global rank: torch.distributed's once a group exists, else torchrun's RANK."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK): which GPU it takes."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """How many processes the launcher started on this node (torchrun's LOCAL_WORLD_SIZE); 1 when launched directly."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def world_size() -> int:
    """How many processes the launcher started (torchrun's WORLD_SIZE); 1 when launched directly."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(setting: str = "auto") -> torch.device:
    """ "auto": this process's GPU (cuda:LOCAL_RANK modulo the GPUs seen) if there is one, else the CPU.

    "cuda" without an index also means this process's GPU; anything else is taken as given.
    """
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
    return device


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


MMAP_THRESHOLD = 64 << 10  # bytes: what vt's processes map (and unmap when freed) instead of keeping in the heap


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc's malloc map every allocation above `threshold` bytes, and unmap it when freed.

    By default glibc raises its mmap threshold to the largest chunk freed so far (up to 32 MiB), after
    which freed tensors of that size stay in the heap as free lists: a training process's resident set
    then grows by what one step allocates and frees (1.2 GiB on the 1.3B memory bench, docs/benchmarks.md;
    with FSDP2 over gloo another 0.7 GiB of all-gather churn).
    A fixed threshold keeps it at what is in use. The cost: each such allocation is a fresh mapping,
    page-faulted and zeroed (a loop of 64 KiB CPU tensors ran 1.8x slower; at 1 MiB the 4-rank bench row
    keeps 0.47x instead of 0.34x). Returns whether it applied (Linux with glibc; a
    MALLOC_MMAP_THRESHOLD_ set in the environment is left to rule, e.g. a larger one for CPU-bound runs)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def keyed_generator(*key: object) -> torch.Generator:
    """A CPU generator seeded by a hash of `key` (e.g. seed, step, sample index): same key, same draws."""
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def encoder_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype frozen encoders and VAEs compute in on `device`: `dtype` (model.dtype), except float32 on a
    CPU, where bfloat16 and float16 convolutions run tens of times slower than float32 ones without native
    instructions for them (a Wan VAE encoding a clip: 30x)."""
    return torch.float32 if device.type == "cpu" else dtype
