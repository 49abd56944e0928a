"""The adapters a LoRA run trains (train.mode = "lora"; the [adapter] section): LoRA, DoRA, LoHa or LoKr on the
family's default targets or `adapter.targets` (vt.shared.adapters builds them, train/model_build.py adds them)."""

from __future__ import annotations

from vt.shared.errors import UserError
from vt.train.parts.base import Part


class AdapterPart(Part):
    section = "adapter"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.train.mode == "lora"

    def check(self, spec, world_size: int) -> None:
        narrow = self.parts["frozen_base"].narrow()
        if self.settings.kind == "dora" and narrow:
            raise UserError(
                f'adapter.kind = "dora" with {narrow}: DoRA divides by the base weight\'s row norms in every '
                "forward, which a float8 or quantized base does not give as peft computes them; set adapter.kind = "
                '"lora" (or "loha", "lokr"), or keep the base in model.dtype'
            )
        tp = self.config.parallel.tp
        if self.settings.kind != "lora" and tp > 1:
            raise UserError(
                f"adapter.kind = {self.settings.kind!r} with parallel.tp = {tp}: tensor parallel splits only LoRA's "
                'two factors; set adapter.kind = "lora", or parallel.tp = 1 (FSDP2 shards any adapter: '
                "parallel.dp_shard)"
            )

    def build_options(self, spec, trains: bool) -> dict:
        settings = self.settings
        return {
            "lora": {"rank": settings.rank, "alpha": settings.alpha, "targets": settings.targets, "kind": settings.kind}
        }

    def trace_key(self) -> tuple:
        return (self.settings.model_dump_json(),)
