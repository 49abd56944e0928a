"""A token budget in place of train.batch_size (token_budget.tokens_per_batch): each bucket's global micro-batch holds
as many samples as fit that many transformer tokens (at least one), so a small bucket takes a larger batch. The plan
traces each bucket at its own batch (train/plan.py: the largest micro-batch's activations count)."""

from __future__ import annotations

from vt.train.parts.base import Part


class TokenBudgetPart(Part):
    section = "token_budget"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.token_budget.tokens_per_batch is not None

    def batch_sizes(self, sizes: dict[str, int], spec, buckets) -> dict[str, int]:
        budget = self.settings.tokens_per_batch
        return {bucket.name: max(1, budget // spec.tokens_per_sample(spec.latent_shape(bucket))) for bucket in buckets}
