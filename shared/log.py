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
# Single messages of loggers that otherwise matter: diffusers says its attention dispatcher is
# experimental every time vt selects a backend (train.attention_backend, logged by vt itself).
QUIET_MESSAGES = {"diffusers.models.modeling_utils": "Attention backends are an experimental feature"}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted, not the one at set-up: tools that
    swap stderr for a while (a CLI runner, a tracker's console capture) must not leave vt writing to a
    closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def get_logger(name: str = "vt") -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"[rank{runtime.rank()}] %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root = logging.getLogger("vt")
        root.addHandler(handler)
        root.setLevel(os.environ.get("VT_LOG_LEVEL", "INFO"))
        root.propagate = False
        for quiet in QUIET_LOGGERS:
            logging.getLogger(quiet).setLevel(logging.ERROR)
        for logger, prefix in QUIET_MESSAGES.items():
            logging.getLogger(logger).addFilter(_DropMessage(prefix))
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("vt") else f"vt.{name}")
