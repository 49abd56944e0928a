"""`python record_models.py run CONFIG ...` (or under torchrun): vt-train, recording every model it builds.

Each instance of a transformers PreTrainedModel or a diffusers ModelMixin subclass built in the process
is logged by class name; at exit the list goes to $VT_BUILT_MODELS.<rank> as JSON. So a test can show
what the trainer loads (the transformer and the VAE) and what it never builds (text or image encoders).
"""

from __future__ import annotations

import atexit
import json
import os
import sys

from diffusers import ModelMixin
from transformers import PreTrainedModel

BUILT: list[str] = []


def record_instances(cls: type) -> None:
    original = cls.__init__

    def init(self, *args, **kwargs):
        BUILT.append(type(self).__name__)
        original(self, *args, **kwargs)

    cls.__init__ = init


def dump() -> None:
    path = f"{os.environ['VT_BUILT_MODELS']}.{os.environ.get('RANK', '0')}"
    with open(path, "w") as f:
        json.dump(BUILT, f)


if __name__ == "__main__":
    record_instances(PreTrainedModel)
    record_instances(ModelMixin)
    atexit.register(dump)
    from vt.train.cli import app

    app(sys.argv[1:], prog_name="vt-train")
