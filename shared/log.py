"""One logger for vt, every line prefixed with the process's rank (from torchrun's RANK)."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False
_WARNED: set[str] = set()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str = "vt") -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank{rank()}] %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root = logging.getLogger("vt")
        root.addHandler(handler)
        root.setLevel(os.environ.get("VT_LOG_LEVEL", "INFO"))
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("vt") else f"vt.{name}")


def warn_once(logger: logging.Logger, message: str) -> None:
    """Warn about an option that silently does nothing, once per process."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
