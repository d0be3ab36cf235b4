"""What the HTTP routers need, built once by GatewayApp (or a test) and handed to `create_app`."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from trainyard_core.store import Store

from .clients import AgentClients, SchedulerClient
from .settings import GatewaySettings
from .tokens import TokenStore


@dataclass(frozen=True)
class GatewayDeps:
    settings: GatewaySettings
    tokens: TokenStore
    scheduler: SchedulerClient
    agents: AgentClients
    store: Store


def get_deps(request: Request) -> GatewayDeps:
    deps = request.app.state.deps
    assert isinstance(deps, GatewayDeps)
    return deps
