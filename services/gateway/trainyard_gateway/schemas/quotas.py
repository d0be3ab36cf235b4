"""Team quotas: the operator's body for PUT /v1/quotas/{team}, and a quota as the API shows it.

Per accelerator model (or "*" for every model without its own entry): `nominal` GPUs are guaranteed to
the team; above that it may borrow idle GPUs, up to `borrow_limit` more (null: no limit), and gangs
running on borrowed GPUs are the first reclaimed when another team needs its nominal share. `weight`
scales the team's fair share among jobs of equal standing.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator

from .common import ApiModel
from .queues import MAX_GPUS

TEAM_RULE = "1-63 lower-case letters, digits or '-', starting with a letter or digit"
TEAM_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class QuotaLimitRequest(ApiModel):
    nominal: Annotated[int, Field(strict=True, ge=0, le=MAX_GPUS, description="GPUs guaranteed to the team")]
    borrow_limit: Annotated[int | None, Field(strict=True, ge=0, le=MAX_GPUS, description=(
        "idle GPUs the team may use above nominal (reclaimable by their owners); null or absent: no limit"))] = None


class QuotaPut(ApiModel):
    """Body of PUT /v1/quotas/{team}: the whole quota (a PUT replaces every field)."""

    weight: Annotated[float, Field(strict=True, gt=0, le=1000, allow_inf_nan=False, description=(
        "fair-share weight: a team of weight 2 is entitled to twice the share of a team of weight 1"))] = 1.0
    limits: dict[str, QuotaLimitRequest] = Field(
        default_factory=dict, max_length=64,
        description='per accelerator model; "*" governs every model without an entry of its own',
        examples=[{"H100-80GB-HBM3": {"nominal": 64, "borrow_limit": 32}, "*": {"nominal": 8}}])

    @field_validator("limits")
    @classmethod
    def _models(cls, value: dict[str, QuotaLimitRequest]) -> dict[str, QuotaLimitRequest]:
        for model in value:
            if not 1 <= len(model) <= 64:
                raise ValueError(f"accelerator model names must be 1-64 characters ('*' for any model), got "
                                 f"{model[:80]!r}")
        return value


class QuotaLimit(ApiModel):
    nominal: int
    borrow_limit: int | None = Field(description="null: no limit")


class Quota(ApiModel):
    team: str
    weight: float
    limits: dict[str, QuotaLimit]


class QuotaList(ApiModel):
    quotas: list[Quota]
