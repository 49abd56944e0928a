"""The GPU stand-in's traces, in a process of their own:
`python tests/helpers/gpu_trace_worker.py CASES.json OUT.json`.

The stand-in device is installed process-wide (a renamed PrivateUse1 backend that torch then takes for the machine's
accelerator), so it never runs inside a test worker that goes on to other tests. Each case is a config tree (and a
GGUF block type, or none); the output is each case's trace (tests/helpers/gpu_standin.py `trace_trainer`), and the NF4
table's copies to the device over three dequantizes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

import torch  # noqa: E402

from helpers import gpu_standin as standin  # noqa: E402


def trace(case: dict) -> dict:
    from vt.shared.buckets import parse_buckets
    from vt.shared.config import Config, build
    from vt.shared.models import spec_for

    config = build(Config, case["config"])
    spec = spec_for(config)
    meta = spec.empty_component("transformer")
    packings = standin.linear_packings(meta, case["gguf"]) if case.get("gguf") else None
    weights = standin.FakeWeights(meta, torch.bfloat16, packings)
    shapes = spec.condition_shapes(parse_buckets(config.buckets.sizes)[0])
    sample = {name: (torch.ones if "mask" in name else torch.zeros)(shape) for name, shape in shapes.items()}
    with standin.standin_components(weights, "transformer.gguf" if case.get("gguf") else None):
        return standin.trace_trainer(config, sample)


def nf4_table_copies() -> list:
    """The host-to-device copies three NF4 dequantizes make (the level table's: once per process)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vt.shared.weights import quantize

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copies = []

    class CountCopies(standin.DeviceBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (
                func is torch.ops.aten._to_copy.default
                and args[0].device.type == "cpu"
                and (kwargs or {}).get("device") == standin.DEVICE
            ):
                copies.append(list(args[0].shape))
            return super().__torch_dispatch__(func, types, args, kwargs)

    try:
        with fake, CountCopies(fake):
            codes = torch.empty(64, 32, dtype=torch.uint8, device=standin.DEVICE)
            absmax = torch.empty(64, 1, device=standin.DEVICE)
            for _ in range(3):
                quantize.dequantize_nf4(codes, absmax, torch.bfloat16)
    finally:
        getattr(quantize, "_PAIRS_ON", {}).pop(standin.DEVICE, None)
    return copies


def main(cases_path: str, out_path: str) -> None:
    standin.install()  # before any backward in this process: autograd sizes its device queues at the first
    cases = json.loads(Path(cases_path).read_text())
    out = {"nf4_table_copies": nf4_table_copies()}
    for name, case in cases.items():
        out[name] = trace(case)
        Path(out_path).write_text(json.dumps(out))  # each case as it is done: the tests wait on theirs


if __name__ == "__main__":
    main(*sys.argv[1:])
