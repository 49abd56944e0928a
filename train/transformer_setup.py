"""The trained transformer(s) of a run, built as its parts and parallel layout say (train/model_build.py builds one:
on the meta device, laid out, filled), and the experts a one-expert run leaves frozen for validation."""

from __future__ import annotations

import torch

from vt.shared.log import get_logger
from vt.train.attention import set_backend
from vt.train.model_build import Dtypes, build_transformer
from vt.train.parallel import parallelize

log = get_logger("vt.train")


class TransformerSetup:
    def __init__(self, config, spec, world, dtypes: Dtypes, parts):
        self.config, self.spec, self.world, self.dtypes, self.parts = config, spec, world, dtypes, parts
        self._frozen_experts: dict[str, torch.nn.Module] | None = None

    def build(self, component: str, mode: str) -> torch.nn.Module:
        """Transformer `component` built on the meta device, laid out by the run's parallel plan and filled; `mode`
        "lora", "full" or "frozen" (validation's other expert: no part converts or swaps it)."""
        parallel, dims, trains = self.config.parallel, self.world.dims, mode != "frozen"
        param_dtype = self.dtypes.param_dtype(mode)  # what FSDP2's all-gather casts to

        def lay_out(model: torch.nn.Module, materialize) -> None:
            if trains:
                self.parts.convert(model, fsdp=dims.fsdp_enabled)
            parallelize(
                model,
                self.spec,
                self.world,
                activation_checkpointing=parallel.activation_checkpointing and trains,
                compile=parallel.compile and trains,
                param_dtype=param_dtype if dims.fsdp_enabled else None,
                cpu_offload=parallel.cpu_offload,
                materialize=materialize,
            )

        options = {"lora": None, **self.parts.build_options(self.spec, trains)}
        return build_transformer(
            self.spec,
            component,
            self.world,
            mode=mode,
            storage_dtype=self.dtypes.storage(mode),
            compute_dtype=self.dtypes.compute,
            frozen_dtype=self.dtypes.frozen,
            parallelize=lay_out,
            seed=self.config.train.seed,
            cpu_offload=parallel.cpu_offload and dims.fsdp_enabled,
            **options,
        )

    def trained(self) -> torch.nn.Module:
        """The trained transformer, or for a run over all experts an nn.ModuleDict expert -> transformer, each laid
        out by the same plan."""
        train, spec = self.config.train, self.spec
        torch.manual_seed(train.seed)
        experts = spec.trained_experts
        if experts:
            transformer = torch.nn.ModuleDict({name: self.build(c, train.mode) for name, c in experts.items()})
        else:
            transformer = self.build(spec.trained_component, train.mode)
        transformer.train()
        modules = set_backend(transformer, train.attention_backend)
        log.info("attention backend %s (diffusers dispatcher, %d attention modules)", train.attention_backend, modules)
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        total = sum(p.numel() for p in transformer.parameters())
        log.info(
            "%s %s: %.2fM trainable of %.2fM parameters on %s",
            spec.family,
            train.mode,
            trainable / 1e6,
            total / 1e6,
            self.world.device,
        )
        return transformer

    def untrained_experts(self) -> dict[str, torch.nn.Module]:
        """The experts a one-expert run does not train, frozen and laid out like the trained one, for the validation
        pipeline (built once, at the first validation)."""
        if self._frozen_experts is None:
            trained = set(self.spec.trained_experts.values()) or {self.spec.trained_component}
            others = [component for component, _ in self.spec.experts().values() if component not in trained]
            self._frozen_experts = {component: self.build(component, "frozen").eval() for component in others}
        return self._frozen_experts
