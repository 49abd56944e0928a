"""`vt-train` under a GPU memory cap, for gpu_check's small-card rows: `python scripts/gpu_capped_run.py GIB run CONFIG`
caps this process at GIB GiB of the GPU (torch.cuda.set_per_process_memory_fraction: an allocation past it fails
as an out-of-memory would on a card that size), then runs the CLI. Without CUDA (the dry run) it runs uncapped."""

from __future__ import annotations

import sys

import torch

if __name__ == "__main__":
    cap = float(sys.argv.pop(1)) * 2**30
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    from vt.train.cli import app

    app()
