"""What a run's settings cannot do together, refused in one place before anything is built or traced.

The trainer calls `check` at start-up and `vt-train plan` for its config and for each setting it tries, so the plan
never offers what the trainer would stop, and says the trainer's own reason for a config it cannot run. Each
refusal names the keys and what to use instead. Checks that need this machine (attention kernels, fp8 hardware)
stay in the trainer (`Trainer._check`, the parts' `check_machine`): a plan is made for another machine.
"""

from __future__ import annotations

from vt.shared.config import Config
from vt.shared.errors import UserError


def check(config: Config, spec, world_size: int, parts=None) -> None:
    """Raise UserError for the first combination of `config`'s settings the trainer cannot run over `world_size`
    ranks with the family `spec`: each part's own refusals (vt.train.parts), the loss path's, pipeline stages'."""
    from vt.train.parts import Parts
    from vt.train.step import LossPath

    (parts or Parts(config)).check(spec, world_size)
    LossPath.check(config, spec)
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
