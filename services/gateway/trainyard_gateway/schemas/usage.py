"""GET /v1/usage: GPU-hours, CPU-hours and cost over a window, grouped (the scheduler's UsageService)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import ConfigDict, Field

from trainyard_core import contract as c

from .common import ApiModel, OneOf

GroupBy = Annotated[str, OneOf(c.USAGE_GROUPS)]


class UsageAmount(ApiModel):
    gpu_hours: float = Field(description="GPU-hours in the window (each GPU a gang held, for the time it held it)")
    cpu_hours: float = Field(description="CPU-hours in the window (the CPUs the gangs asked for per node)")
    cost: float = Field(description="GPU-hours times the price per GPU-hour of their accelerator model, in "
                                    "`currency`")
    unpriced_gpu_hours: float = Field(description="GPU-hours of models without a price (counted at cost 0; "
                                                  "the models are named in `unpriced_models`)")


class UsageRow(UsageAmount):
    group: str = Field(description="the team, the project label (\"\" for jobs without one), the user, the "
                                   "accelerator model (\"\" CPU-only, a mixed gang's models joined by \"+\"), the "
                                   "queue or the job id, by `group_by`")


class UsageReport(ApiModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    from_: datetime = Field(alias="from", description="the window's start (inclusive)")
    to: datetime = Field(description="the window's end (exclusive)")
    group_by: GroupBy
    team: str = Field(description="the team whose use this is; \"\" every team (operators)")
    currency: str = Field(description="ISO 4217 code of `cost` and `prices`")
    prices: dict[str, float] = Field(description="price per GPU-hour of each accelerator model (the scheduler's "
                                                 "usage_prices setting)")
    rows: list[UsageRow] = Field(description="one per group with any use in the window, the largest first "
                                             "(GPU-hours, then CPU-hours, then name), at most `limit`")
    groups: int = Field(description="how many groups had any use (more than `rows` holds when `limit` cut them)")
    total: UsageAmount = Field(description="every group's use together (the rows cut by `limit` too)")
    unpriced_models: list[str] = Field(description="models used in the window that have no price")
    computed_at: datetime = Field(description="running gangs are counted up to this time")
