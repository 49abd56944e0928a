"""Families whose noise levels are split between several transformers (Wan 2.2 A14B's two experts).

Mixed into ModelSpec: a family declares `experts()`; a run trains one of them (`model.expert`, else the
first) or all of them in one run (`model.expert = "all"`, each sample by the expert of its sigma).
"""

from __future__ import annotations

from vt.shared.errors import UserError

ALL_EXPERTS = "all"  # model.expert: train every expert of a multi-expert family in one run


class ExpertsMixin:
    """Uses the spec's `config` (ModelConfig) and `family`."""

    def experts(self) -> dict[str, tuple[str, tuple[float, float]]]:
        """Expert name -> (transformer component, sigma range it denoises), for families that split the
        noise levels between several transformers (Wan 2.2 A14B); empty for one transformer."""
        return {}

    def check_expert(self) -> None:
        """`model.expert` names an expert of this family (or "all"), or is unset."""
        experts = self.experts()
        if self.config.expert not in ("", *experts, *((ALL_EXPERTS,) if experts else ())):
            raise UserError(
                f"model.expert = {self.config.expert!r} is not an expert of {self.family!r}; "
                + (f"choose one of {[*experts, ALL_EXPERTS]}" if experts else "it has one transformer: leave it unset")
            )

    @property
    def expert(self) -> str | None:
        """The expert this run trains (`model.expert`, else the first), None for one transformer or
        when the run trains all of them (`model.expert = "all"`)."""
        if not self.experts() or self.trains_all_experts:
            return None
        return self.config.expert or next(iter(self.experts()))

    @property
    def trains_all_experts(self) -> bool:
        """`model.expert = "all"`: one run trains every expert, each sample by the expert of its sigma."""
        return self.config.expert == ALL_EXPERTS

    @property
    def trained_experts(self) -> dict[str, str]:
        """Expert -> transformer component for a run that trains all experts; {} for one transformer."""
        return {name: component for name, (component, _) in self.experts().items()} if self.trains_all_experts else {}

    @property
    def trained_component(self) -> str:
        """The transformer component this run trains and exports (one expert, or the only transformer)."""
        if self.trains_all_experts:
            raise UserError('model.expert = "all" trains several transformers: see trained_experts')
        return self.experts()[self.expert][0] if self.expert else "transformer"

    def sigma_range(self) -> tuple[float, float]:
        """The noise levels this run trains: all of them, or the trained expert's range."""
        return self.experts()[self.expert][1] if self.expert else (0.0, 1.0)

    def expert_of(self, sigma: float) -> str:
        """The expert that denoises at `sigma`: the one whose [low, high) range holds it (the top range
        also holds 1), as the pipeline hands over at its boundary."""
        for name, (_, (low, high)) in self.experts().items():
            if low <= sigma < high or sigma == high == 1.0:
                return name
        raise ValueError(f"sigma {sigma} is in no expert's range: {self.experts()}")
