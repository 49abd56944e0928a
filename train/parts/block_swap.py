"""Block swap ([block_swap] blocks_on_gpu): one GPU keeps the first `blocks_on_gpu` blocks' frozen weights, the others
are built in pinned host memory and copied in a block ahead of use (the mechanism: train/parallel/block_swap.py).
Its memory model: the swapped blocks' frozen weights leave the device's weights (and its start-up), their arenas are
host memory, and two of them are in flight on the device during a step; its time: their weights in for the forward
and again for the backward's recomputation."""

from __future__ import annotations

from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.train.parallel.block_swap import BlockSwap, memory, swapped_blocks
from vt.train.parts.base import ModelMemory, Part, RunContext, change, with_checkpointing

log = get_logger("vt.train.block_swap")


class BlockSwapPart(Part):
    section = "block_swap"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.block_swap.blocks_on_gpu is not None

    def check(self, spec, world_size: int) -> None:
        resident, train, parallel = self.settings.blocks_on_gpu, self.config.train, self.config.parallel
        refusal = None
        if train.mode != "lora":
            refusal = (
                f"swaps frozen weights, but train.mode = {train.mode!r} trains them all; use parallel.cpu_offload = "
                'true for a full fine-tune on one GPU, or train.mode = "lora"'
            )
        elif not parallel.activation_checkpointing:
            refusal = (
                "swaps blocks' weights out after their forward, which only activation checkpointing leaves unsaved: "
                "set parallel.activation_checkpointing = true as well"
            )
        elif world_size > 1 or spec.trained_experts:
            refusal = (
                "is for one process training one transformer; with more GPUs shard the model instead "
                "(parallel.dp_shard), or train one expert per run (model.expert)"
            )
        elif parallel.compile:
            refusal = (
                "with parallel.compile: a compiled block would trace the swap's stream waits and weight exchanges "
                "into its graph; set parallel.compile = false (block swap is for cards the weights do not fit, "
                "where the copies, not the kernels, set the pace)"
            )
        elif parallel.cpu_offload:
            refusal = (
                "with parallel.cpu_offload: CPU offload keeps every weight in host memory already (FSDP2 copies "
                "each block in for its use); use one of the two, block_swap.blocks_on_gpu for a LoRA's frozen base"
            )
        elif parallel.cp > 1 or parallel.tp > 1 or parallel.pp > 1:
            refusal = "is for one process: set parallel.cp, parallel.tp and parallel.pp to 1"
        if refusal:
            raise UserError(f"block_swap.blocks_on_gpu = {resident} {refusal}")

    @classmethod
    def alternatives(cls, config, gpus: int) -> list:
        if gpus != 1 or config.train.mode != "lora" or config.block_swap.blocks_on_gpu is not None:
            return []
        return [
            with_checkpointing(change("swap", f"block_swap.blocks_on_gpu={n}", "block_swap", blocks_on_gpu=n))
            for n in (20, 10, 5, 0)
        ]

    def build_options(self, spec, trains: bool) -> dict:
        resident = self.settings.blocks_on_gpu
        return {"host_blocks": lambda model: swapped_blocks(spec, model, resident)} if trains else {}

    def start(self, run: RunContext) -> None:
        resident = self.settings.blocks_on_gpu
        blocks = [block for _, block in run.spec.named_blocks(run.transformer)]
        self.swap = BlockSwap(blocks, resident, run.device)
        log.info(
            "block swap: %d of %d blocks on %s, %d in host memory",
            min(resident, len(blocks)),
            len(blocks),
            run.device,
            len(self.swap.swapped),
        )

    def after_optimizer_step(self) -> None:
        self.swap.release()

    def model_memory(self, memory_of: ModelMemory) -> None:
        if memory_of.mode == "frozen":
            return
        swap, rank = memory(memory_of.spec, memory_of.model, self.settings.blocks_on_gpu), memory_of.rank
        rank.weights -= swap.frozen
        rank.startup -= swap.frozen  # built in host memory
        rank.swapped += swap.host
        rank.in_flight = max(rank.in_flight, swap.device)

    def transfers(self, plan) -> tuple[float, float]:
        rank = plan.rank
        first = rank.in_flight / 2 if self.settings.blocks_on_gpu == 0 else 0  # the first block, before any compute
        return 2 * rank.swapped, first
