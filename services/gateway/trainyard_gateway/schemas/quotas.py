"""Team quotas: the operator's body for PUT /v1/quotas/{team}, and a quota as the API shows it.

Per accelerator model (or "*" for every model without its own entry): `nominal` GPUs are guaranteed to
the team; above that it may borrow idle GPUs, up to `borrow_limit` more (null: no limit), and gangs
running on borrowed GPUs are the first reclaimed when another team needs its nominal share. `weight`
scales the team's fair share among jobs of equal standing. A quota as read also shows `use`: what the team's
gangs hold now under each key, and how much of that is borrowed.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from trainyard_core import contract as c

from .common import ApiModel, Number, integer, keys_matching, matching


class QuotaLimitRequest(ApiModel):
    nominal: int = integer(ge=0, le=c.MAX_GPUS, description="GPUs guaranteed to the team")
    borrow_limit: int | None = integer(None, ge=0, le=c.MAX_GPUS, description=(
        "idle GPUs the team may use above nominal (reclaimable by their owners); null or absent: no limit"))


class QuotaPut(ApiModel):
    """Body of PUT /v1/quotas/{team}: the whole quota (a PUT replaces every field)."""

    weight: Annotated[Number, Field(gt=0, le=c.MAX_QUOTA_WEIGHT, description=(
        "fair-share weight: a team of weight 2 is entitled to twice the share of a team of weight 1"))] = 1.0
    limits: dict[Annotated[str, matching(c.MODEL_NAME)], QuotaLimitRequest] = Field(
        default_factory=dict, max_length=c.MAX_QUOTA_MODELS, json_schema_extra=keys_matching(c.MODEL_NAME),
        description=f'per accelerator model; "{c.ANY_MODEL}" governs every model without an entry of its own',
        examples=[{"H100-80GB-HBM3": {"nominal": 64, "borrow_limit": 32}, "*": {"nominal": 8}}])


class QuotaLimit(ApiModel):
    nominal: int
    borrow_limit: int | None = Field(description="null: no limit")


class QuotaUse(ApiModel):
    in_use: int = Field(description="GPUs the team's running gangs hold under this key now")
    borrowed: int = Field(description=(
        "of those, GPUs in gangs placed on borrowed quota: the first reclaimed when the owners of the idle "
        "capacity they use need it"))


class Quota(ApiModel):
    team: str
    weight: float
    limits: dict[str, QuotaLimit]
    use: dict[str, QuotaUse] = Field(default_factory=dict, description=(
        "what the team holds now, by the key its GPUs are accounted under: a model with its own entry, "
        f'"{c.ANY_MODEL}" for the models that entry governs, or a model no entry covers (all of it borrowed). '
        "Keys with nothing held are left out"))


class QuotaList(ApiModel):
    quotas: list[Quota]
