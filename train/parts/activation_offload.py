"""Activation offload ([activation_offload] enabled): with activation checkpointing, what a step saves for backward
waits in pinned host memory (the mechanism: train/parallel/offload.py). Its memory model: the plan traces the step
with the saved tensors leaving the device (the "offload" kind), the host arena the largest micro-step fills; its
time: each saved input out and back, the first one backward takes back not overlapped. On a CPU host memory is where
they were already: the plan counts the checkpointed step."""

from __future__ import annotations

from vt.shared.errors import UserError
from vt.train.parallel.offload import OffloadSaved
from vt.train.parts.base import Part, RunContext, change, with_checkpointing


class ActivationOffloadPart(Part):
    section = "activation_offload"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.activation_offload.enabled

    def check(self, spec, world_size: int) -> None:
        if not self.config.parallel.activation_checkpointing:
            raise UserError(
                "activation_offload.enabled = true moves the checkpointed blocks' inputs to host memory: set "
                "parallel.activation_checkpointing = true as well"
            )

    @classmethod
    def alternatives(cls, config, gpus: int) -> list:
        if config.activation_offload.enabled:
            return []
        return [
            with_checkpointing(change("offload", "activation_offload.enabled=true", "activation_offload", enabled=True))
        ]

    def start(self, run: RunContext) -> None:
        self.offload = OffloadSaved(run.device)

    def forward_context(self):
        return self.offload()

    def after_backward(self) -> None:
        self.offload.done()  # every saved tensor came back: the host arena is free again

    def after_optimizer_step(self) -> None:
        self.offload.done()  # (pipeline stages: the step's backwards are over only now)

    def activation_kind(self, kind: str, device: str) -> str:
        return "offload" if device == "cuda" else kind

    def run_memory(self, plan) -> None:
        if plan.device != "cuda":
            return
        cp = plan.dims.cp
        plan.rank.offloaded = max(a.get("offload_host", 0) for a in plan.activations.values()) // cp
        plan.offload_largest = max(a.get("offload_largest", 0) for a in plan.activations.values()) // cp

    def transfers(self, plan) -> tuple[float, float]:
        return 2 * plan.rank.offloaded, plan.offload_largest
