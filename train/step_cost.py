"""What a memory setting costs in step time: the estimate `vt-train plan --gpu-memory` orders what fits by.

One rank's optimizer step is `train.grad_accum` micro-batches, each the plan's measured FLOPs of the largest
bucket's forward and backward (vt.shared.memory_trace.FlopCount over the fake step: checkpointing's recomputed
forward is in the count) over the context- and tensor-parallel degrees, at an achieved throughput, plus a quantized
base's dequantizing (each packed weight unpacked once a pass, its bytes written and read at the device memory's
rate), overlapped with what the setting moves over PCIe per micro-batch: the saved block inputs out and back
(`activation_offload.enabled`), the swapped blocks' frozen weights in for the forward and again for the backward
(`block_swap.blocks_on_gpu`); what cannot overlap is added: the first input backward takes back, the first swapped
block's weights when no resident block runs before it. CPU offload (`parallel.cpu_offload`) adds, once a step and not overlapped, the weights
and gradients crossing PCIe and the optimizer's step over host memory. Collectives are left out (the same for the
settings compared on one layout).

The rates are a 24-32 GB card's of this generation as achieved, not as sold: 70 TFLOPS (about 40% of an RTX 4090's
bf16 peak), 22 GB/s over PCIe 4.0 x16 from pinned memory, 10 GB/s for an optimizer step over host memory.
scripts/gpu_check.sh measures the real ones where a GPU is lent. The estimate orders settings; it is no timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from vt.train.parts import Parts


@dataclass(frozen=True)
class Rates:
    flops: float = 70e12  # achieved FLOP/s of the card
    pcie: float = 22e9  # bytes/s host <-> device, pinned
    host: float = 10e9  # bytes/s of an optimizer step over host memory (read and write of each state)
    memory: float = 0.8e12  # bytes/s of device memory (an RTX 4090's 1 TB/s as achieved): what dequantizing costs


CARD = Rates()


def step_seconds(plan, rates: Rates = CARD) -> float | None:
    """Estimated seconds of one optimizer step of `plan` on one rank (None where the plan measured no FLOPs)."""
    parallel, rank = plan.config.parallel, plan.rank
    kind = "checkpointing" if parallel.activation_checkpointing else "none"
    if not plan.flops.get(kind):
        return None
    compute = plan.flops[kind] / (plan.dims.cp * plan.dims.tp) / rates.flops
    # A quantized base dequantizes each packed weight for each matmul: forward, backward and, under checkpointing,
    # the recomputed forward; each pass writes and reads what `unpack` makes (plan.dequantized: its bytes).
    passes = 3 if parallel.activation_checkpointing else 2
    compute += passes * 2 * plan.dequantized / rates.memory
    moved, exposed = Parts(plan.config).transfers(plan)  # the parts' copies over PCIe (vt.train.parts)
    per_micro = max(compute, moved / rates.pcie) + exposed / rates.pcie
    offload = (rank.weights + rank.gradients) / rates.pcie + rank.optimizer / rates.host if parallel.cpu_offload else 0
    return plan.config.train.grad_accum * per_micro + offload


def by_step_time(
    base, options: list[tuple[str, object]], rates: Rates = CARD
) -> list[tuple[str, object, float | None]]:
    """(label, plan, step time against `base`'s) of each option, quickest first (unknown estimates last)."""
    reference = step_seconds(base, rates)
    rows = []
    for label, plan in options:
        seconds = step_seconds(plan, rates)
        rows.append((label, plan, seconds / reference if seconds is not None and reference else None))
    return sorted(rows, key=lambda row: (row[2] is None, row[2] or 0.0))
