"""GET /healthz: the gateway is up; whether it reaches the scheduler and etcd."""

from __future__ import annotations

from typing import Literal

from .common import ApiModel


class DependencyHealth(ApiModel):
    reachable: bool
    detail: str


class Health(ApiModel):
    status: Literal["ok", "degraded"]
    scheduler: DependencyHealth
    etcd: DependencyHealth
