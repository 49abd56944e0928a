"""How a LoRA's frozen transformer is stored ([frozen_base]): float8 (`fp8`, train/fp8.py and frozen_storage.py) or
quantized as it is read (`quantize`: nf4 / int8, train/packed_base.py), and a base read from one file of quantized
blocks (GGUF; kept packed whatever the settings). Its memory model: the packed weights' scales, the widest layer
dequantized for its matmul, and a quantize-at-read fill's largest full-precision weight."""

from __future__ import annotations

from dataclasses import replace

from vt.shared.errors import UserError
from vt.train.packed_base import PackedLinear, unpack_peak
from vt.train.parts.base import ModelMemory, Part, change


class FrozenBasePart(Part):
    section = "frozen_base"

    def check(self, spec, world_size: int) -> None:
        """fp8 and quantized bases are for LoRA (a full fine-tune trains those weights: fp8_training.recipe); the two
        narrow storages exclude each other."""
        fp8, quantize = self.settings.fp8, self.settings.quantize
        mode = self.config.train.mode
        if fp8 and mode != "lora":
            raise UserError(
                'frozen_base.fp8 = true stores frozen weights in float8, but train.mode = "full" trains them all; use '
                'fp8_training.recipe = "rowwise" (or "tensorwise") for full fine-tuning, or set train.mode = "lora"'
            )
        if quantize != "none" and (mode != "lora" or fp8):
            raise UserError(
                f"frozen_base.quantize = {quantize!r} quantizes the frozen base of a LoRA: it needs "
                'train.mode = "lora" and frozen_base.fp8 = false (one narrow storage)'
            )

    def narrow(self) -> str | None:
        """The setting that stores the base narrower than model.dtype ("frozen_base.fp8 = true" ...), None if none."""
        if self.settings.fp8:
            return "frozen_base.fp8 = true"
        return None if self.settings.quantize == "none" else f"frozen_base.quantize = {self.settings.quantize!r}"

    @classmethod
    def alternatives(cls, config, gpus: int) -> list:
        settings = config.frozen_base
        if config.train.mode != "lora" or settings.fp8 or settings.quantize != "none":
            return []
        return [change("base", "frozen_base.fp8=true", "frozen_base", fp8=True)] + [
            change("base", f"frozen_base.quantize={kind}", "frozen_base", quantize=kind) for kind in ("int8", "nf4")
        ]

    def dtypes(self, dtypes):
        return replace(dtypes, fp8_base=self.settings.fp8)

    def build_options(self, spec, trains: bool) -> dict:
        return {"quantize": self.settings.quantize}

    def trace_key(self) -> tuple:
        return ()  # the trace holds frozen weights as they compute: every storage traces the same step

    def model_memory(self, memory: ModelMemory) -> None:
        """A packed weight's scales stay with it; it is dequantized for its matmul; quantized at read, the fill reads
        the file's full-precision weight first."""
        trained, rank = memory.mode != "frozen", memory.rank
        for module in memory.model.modules():
            if not isinstance(module, PackedLinear):
                continue
            memory.widest = max(memory.widest, unpack_peak(module))
            memory.dequantized += unpack_peak(module) if trained else 0
            if self.settings.quantize != "none":
                rank.fill = max(rank.fill, module.in_features * module.out_features * memory.dtypes.frozen.itemsize)
            scale = getattr(module, "weight_scale", None)
            scales = 0 if scale is None else scale.numel() * scale.element_size()
            rank.weights += scales
            rank.startup += scales if trained else 0
