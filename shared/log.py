"""One logger for vt, every line prefixed with the process's rank (from torchrun's RANK)."""

from __future__ import annotations

import logging
import os
import sys

from vt.shared import runtime

_CONFIGURED = False
# Third-party import-time chatter that says nothing about a run: torchao (imported by transformers and
# diffusers whenever it is installed, e.g. with the fp8 extra) warns about optional kernels it cannot
# load for this torch and about enum registrations, and diffusers about torchao tensor types it does
# not find (for loading torchao-quantized checkpoints, which vt does not). Errors still get through.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


def get_logger(name: str = "vt") -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank{runtime.rank()}] %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root = logging.getLogger("vt")
        root.addHandler(handler)
        root.setLevel(os.environ.get("VT_LOG_LEVEL", "INFO"))
        root.propagate = False
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("vt") else f"vt.{name}")
