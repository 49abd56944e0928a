"""The base of every config section: a strict pydantic model (vt.shared.config, vt.shared.part_configs)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # strict: no bool for an int, no string for a number (a float key still takes an int); no inf/nan
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
