"""LoRA for every family: adding adapters, what a full fine-tune trains, and the exported files.

A family declares data: `default_lora_targets`, `lora_exclusions` (modules no adapter may reach) and its ComfyUI
key table (`original_names`, `comfy_fused`, `comfy_alpha`; comfy.py). Export writes the pipeline's
`load_lora_weights` file and lora_comfyui.safetensors, and refuses a NaN or inf tensor (a diverged run would ship
a LoRA that renders black videos). The adapters are LoRA or another kind (`adapter.kind`, vt/shared/adapters.py);
comfy_adapters.py writes the ComfyUI file of a LoHa or LoKr.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from vt.shared import adapters
from vt.shared.errors import UserError
from vt.shared.weights import comfy, comfy_adapters

log = logging.getLogger(__name__)


def lora_weight_name(expert: str | None = None) -> str:
    """The diffusers LoRA file: pytorch_lora_weights.safetensors, with `_<expert>` for one of several
    experts trained in one run."""
    return f"pytorch_lora_weights_{expert}.safetensors" if expert else "pytorch_lora_weights.safetensors"


def check_finite(tensors: dict[str, Tensor], step: int | None) -> None:
    """Refuse to export a LoRA with a NaN or inf value, naming the first such tensor and the step."""
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            kind = "NaN" if torch.isnan(tensor).any() else "inf"
            at = f" at step {step}" if step is not None else ""
            raise UserError(
                f"LoRA tensor {name} holds {kind} values{at}: the run diverged, so the LoRA is not "
                "written (it would render black or noise). Resume from an earlier checkpoint with a "
                "lower train.lr or train.max_grad_norm set"
            )


class LoraMixin:
    """Uses the spec's `family`, `expert`, `config`, `sound`, `pipeline_class()` and `load_config()`."""

    default_lora_targets: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    # (diffusers module regex, original module name) pairs, first full match wins; see comfy.py.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ()
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = ()  # diffusers modules that are one original module
    comfy_alpha: ClassVar[bool] = True  # whether the family's loaders read `.alpha` (else baked into lora_B)
    # Whether the file's metadata carries `lora_exclusions` (as exclude_modules), so a loader building its
    # LoraConfig from it adds no untrained adapters there; off where the loader targets the file's keys
    # only (an exclusion there just makes peft warn that nothing was excluded).
    exclusions_in_metadata: ClassVar[bool] = True
    excluded_modules_named: ClassVar[str] = "the modules no LoRA may reach"  # `lora_exclusions`, in errors
    _lora_metadata: dict[str, Any] | None = None

    def lora_exclusions(self, transformer) -> str | None:
        """A regular expression of modules no adapter may reach, matched whole (None: none)."""
        return None

    def check_lora(self, transformer, targets) -> None:
        """Called after the adapters are added: refuse targets that reach modules the run never trains (the
        sound stream's, `sound.parameters`, in a video-only run)."""
        if self.sound is None or self.config.audio:
            return
        audio = re.compile(self.sound.parameters)
        reached = sorted(
            {
                adapters.module_of(n)
                for n, _ in transformer.named_parameters()
                if adapters.is_adapter(n) and audio.search(n)
            }
        )
        if reached:
            raise UserError(
                f"adapter.targets {targets} reach the audio stream ({reached[0]}, ...), which "
                f"{self.family} trains only with model.audio = true; set it to train the sound, or name "
                f"other modules (suffixes such as {self.default_lora_targets[0]!r}), or leave "
                "adapter.targets unset"
            )

    def add_lora(
        self, transformer, rank: int, alpha: float, targets: list[str] | str | None, kind: str = "lora"
    ) -> None:
        """Freeze the transformer and inject peft adapters of `kind` (adapter.kind) on `targets` (names matched
        by suffix, or one regular expression matched whole), never on `lora_exclusions`; only the adapters train."""
        if rank < 1:
            raise UserError(f"adapter.rank must be >= 1, got {rank}")
        targets = targets if isinstance(targets, str) else list(targets or self.default_lora_targets)
        excluded = self.lora_exclusions(transformer)
        transformer.requires_grad_(False)
        unmatched = ValueError(
            f"adapter.targets {targets} matched no layer of the {self.family} transformer"
            + (f" outside {self.excluded_modules_named}" if excluded else "")
        )
        with warnings.catch_warnings():  # peft warns when the targets never reached the excluded modules anyway
            warnings.filterwarnings("ignore", message=".*no modules were excluded.*")
            try:
                transformer.add_adapter(adapters.peft_config(adapters.metadata(kind, rank, alpha, targets, excluded)))
            except ValueError as err:  # peft: no module targeted
                raise unmatched from err
        if not any(adapters.is_adapter(n) for n, _ in transformer.named_parameters()):
            raise unmatched
        self.check_lora(transformer, targets)
        self._lora_metadata = adapters.metadata(
            kind, rank, alpha, targets, excluded if self.exclusions_in_metadata else None
        )

    def full_trainable(self, transformer) -> None:
        """Mark what a full fine-tune trains: every parameter, but the sound stream's (`sound.parameters`) in a
        video-only run (no gradient reaches them: DDP would wait for one), and what else a family leaves out."""
        transformer.requires_grad_(True)
        if self.sound is not None and not self.config.audio:
            audio = re.compile(self.sound.parameters)
            for name, param in transformer.named_parameters():
                param.requires_grad_(not audio.search(name))

    # ----------------------------------------------------------------------------- export
    def save_lora(
        self,
        lora_state_dict: dict[str, Tensor],
        out_dir,
        lora_config: dict | None = None,
        expert: str | None = None,
        step: int | None = None,
    ) -> Path:
        """out_dir/pytorch_lora_weights.safetensors, readable by the pipeline's load_lora_weights, and
        out_dir/lora_comfyui.safetensors under the original module names (comfy.py); returns the first.

        The rank/alpha/targets go into the file's metadata so the loader rebuilds the same scaling;
        they come from this spec's `add_lora` unless `lora_config` ({r, lora_alpha, target_modules}) is given.
        `expert`: the LoRA of that expert in a run over all experts, written as
        pytorch_lora_weights_<expert>.safetensors and lora_comfyui_<expert>.safetensors. `step` names the
        training step in the error a NaN or inf tensor raises.
        """
        metadata = lora_config or self._lora_metadata
        if metadata is None:
            raise UserError(
                "save_lora needs the LoRA rank and alpha: call add_lora on this spec first "
                "or pass lora_config={'r': ..., 'lora_alpha': ..., 'target_modules': [...]}"
            )
        if not lora_state_dict or not all(adapters.is_adapter(k) for k in lora_state_dict):
            raise ValueError(
                "lora_state_dict must be peft's get_peft_model_state_dict(transformer): "
                "keys like 'blocks.0.attn1.to_q.lora_A.weight' (or another kind's, adapters.py)"
            )
        check_finite(lora_state_dict, step)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in lora_state_dict.items()}
        weight_name = lora_weight_name(expert)
        if hasattr(self.pipeline_class(), "save_lora_weights"):
            self.pipeline_class().save_lora_weights(
                out,
                transformer_lora_layers=tensors,
                safe_serialization=True,
                weight_name=weight_name,
                transformer_lora_adapter_metadata=dict(metadata),
            )
        else:  # a pipeline without a LoRA mixin (HunyuanVideo 1.5): diffusers' own writer, the same file format
            from diffusers.loaders.lora_base import LoraBaseMixin

            LoraBaseMixin._save_lora_weights(
                out, {"transformer": tensors}, {"transformer": dict(metadata)}, weight_name=weight_name
            )
        self.save_comfy_lora(tensors, out / comfy.filename(expert or self.expert), metadata)
        return out / weight_name

    def lora_load_kwargs(self, expert: str | None = None) -> dict[str, Any]:
        """What `pipeline.load_lora_weights` needs besides the file to load this run's LoRA (or that of
        `expert`): which transformer it goes into."""
        return {}

    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """Load a LoRA file `save_lora` wrote (the diffusers or the ComfyUI one, by `weight_name`) into
        `pipeline`: its own `load_lora_weights` with `lora_load_kwargs`; a family whose pipeline has no
        LoRA loader gives its own."""
        kwargs = {"weight_name": weight_name} if weight_name else {}
        pipeline.load_lora_weights(folder, **kwargs, **self.lora_load_kwargs(expert))

    def comfy_tensors(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """The LoRA tensors in the original model's layout, before renaming (e.g. halves swapped)."""
        return tensors

    def comfy_out_features(self, module: str) -> int:
        """Output features of a transformer Linear (a fused part without a LoRA gets that many zero rows),
        from its config: no weights allocated."""
        if getattr(self, "_linear_sizes", None) is None:
            from accelerate import init_empty_weights

            with init_empty_weights():
                model = self.component_classes()["transformer"].from_config(self.load_config("transformer"))
            self._linear_sizes = {n: m.out_features for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        return self._linear_sizes[module]

    def save_comfy_lora(self, tensors: dict[str, Tensor], path: Path, metadata: dict) -> Path | None:
        """The ComfyUI form of a LoRA (or LoHa, LoKr: comfy_adapters.py); None (with a warning) when the family
        has no key table, a module has no original name, or ComfyUI would load the kind otherwise (DoRA)."""
        from safetensors.torch import save_file

        kind = adapters.kind_of(tensors)
        try:
            if not self.original_names and not self.comfy_fused:
                raise ValueError(f"family {self.family!r} has no original key table")
            if kind != "lora":
                state = comfy_adapters.comfy_state_dict(
                    kind,
                    tensors,
                    self.original_names,
                    int(metadata["r"]),
                    float(metadata["alpha" if "alpha" in metadata else "lora_alpha"]),
                    fused=self.comfy_fused,
                )
            else:
                state = comfy.comfy_state_dict(
                    self.comfy_tensors(tensors),
                    self.original_names,
                    int(metadata["r"]),
                    float(metadata["lora_alpha"]),
                    write_alpha=self.comfy_alpha,
                    fused=self.comfy_fused,
                    out_features=self.comfy_out_features,
                )
        except ValueError as err:
            log.warning("%s saved for diffusers only: %s", "LoRA" if kind == "lora" else kind, err)
            return None
        save_file(state, str(path), metadata={"format": "pt", "vt_family": self.family, "vt_adapter": kind})
        return path

    def save_full(self, transformer, out_dir) -> Path:
        """save_pretrained into out_dir; usable as model.components.transformer."""
        out = Path(out_dir)
        transformer.save_pretrained(out, safe_serialization=True)
        return out
