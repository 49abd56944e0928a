"""What a run's settings cannot do together, refused in one place before anything is built or traced.

The trainer calls `check` at start-up and `vt-train plan` for its config and for each setting it tries, so the plan
never offers what the trainer would stop, and says the trainer's own reason for a config it cannot run. Each
refusal names the keys and what to use instead. Checks that need this machine (attention kernels, fp8 hardware)
stay in the trainer (`Trainer._check_kernels`): a plan is made for another machine.
"""

from __future__ import annotations

from vt.shared.config import Config
from vt.shared.errors import UserError
from vt.train.fp8 import check_fp8_base
from vt.train.parallel import block_swap


def check(config: Config, spec, world_size: int) -> None:
    """Raise UserError for the first combination of `config`'s settings the trainer cannot run over `world_size`
    ranks with the family `spec`."""
    train, parallel = config.train, config.parallel
    check_fp8_base(train)
    if train.mode == "lora" and train.adapter != "lora" and parallel.tp > 1:
        raise UserError(
            f"train.adapter = {train.adapter!r} with parallel.tp = {parallel.tp}: tensor parallel splits "
            'only LoRA\'s two factors; set train.adapter = "lora", or parallel.tp = 1 (FSDP2 shards any '
            "adapter: parallel.dp_shard)"
        )
    if parallel.blocks_on_gpu is not None and train.mode != "lora":
        raise UserError(
            f"parallel.blocks_on_gpu = {parallel.blocks_on_gpu} swaps frozen weights, but train.mode = "
            f"{train.mode!r} trains them all; use parallel.cpu_offload = true for a full fine-tune on one "
            'GPU, or train.mode = "lora"'
        )
    block_swap.check(parallel, world_size, spec.trained_experts)
    if train.caption_dropout > 0 and spec.text_with_image:
        raise UserError(
            f"train.caption_dropout = {train.caption_dropout}: {spec.family}'s text encoder reads each "
            "caption together with its clip's first frame, so the window's empty caption cannot stand in "
            "for a sample's text; set train.caption_dropout = 0"
        )
    if train.loss_weighting != "none" and config.model.diffusion_forcing:
        raise UserError(
            f"train.loss_weighting = {train.loss_weighting!r} weights each sample by its sigma, but "
            'model.diffusion_forcing draws one sigma per latent frame; set train.loss_weighting = "none"'
        )
    check_pipeline_stages(config, spec)


def check_pipeline_stages(config: Config, spec) -> None:
    """parallel.pp > 1 (train/parallel/pp.py): what pipeline stages cannot run yet."""
    pp = config.parallel.pp
    if pp == 1:
        return
    if spec.pipeline_refusal:
        raise UserError(f"parallel.pp = {pp} with {spec.family}: {spec.pipeline_refusal}; set parallel.pp = 1")
    if config.model.audio:
        raise UserError(
            f"parallel.pp = {pp} with model.audio: the audio stream's loss is not carried through the "
            "pipeline stages; set parallel.pp = 1 to train sound"
        )
    if spec.trained_experts:
        raise UserError(
            f"parallel.pp = {pp} with several experts in one run: each expert would need its own pipeline; "
            "train one expert per run (model.expert) or set parallel.pp = 1"
        )
