"""One logger for vt, every line prefixed with the process's rank (from torchrun's RANK)."""

from __future__ import annotations

import logging
import os
import sys

from vt.shared import runtime

_CONFIGURED = False


def get_logger(name: str = "vt") -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank{runtime.rank()}] %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root = logging.getLogger("vt")
        root.addHandler(handler)
        root.setLevel(os.environ.get("VT_LOG_LEVEL", "INFO"))
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("vt") else f"vt.{name}")
