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


# What the libraries read when they are imported (both CLIs import them after the config is loaded).
QUIET_ENVIRONMENT = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def apply_level(level: str) -> None:
    """log.level: "info" hides the libraries' progress bars and notices (transformers' "Loading weights",
    diffusers' "Loading pipeline components", huggingface_hub's downloads), so the terminal holds vt's own
    progress line per stage and its summary lines; "debug" shows them all, and vt's debug lines too.
    An environment variable the user set wins; a library imported already is told directly."""
    get_logger().setLevel(logging.DEBUG if level == "debug" else os.environ.get("VT_LOG_LEVEL", "INFO"))
    if level == "debug":
        return
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    for library in ("transformers", "diffusers"):
        if library in sys.modules:
            library_logging = __import__(f"{library}.utils.logging", fromlist=["logging"])
            library_logging.disable_progress_bar()
            library_logging.set_verbosity_error()
