"""What the HTTP routers need, built once by GatewayApp (or a test) and handed to `create_app`."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from trainyard_core.audit import AuditLog
from trainyard_core.store import Store

from .checkpoint_client import CheckpointStoreClient
from .clients import AgentClients, SchedulerClient
from .fleet_metrics import FleetHistory, LatestGpus
from .job_view import JobView
from .rate_limit import TokenBuckets
from .settings import GatewaySettings
from .tokens import TokenStore


@dataclass(frozen=True)
class GatewayDeps:
    settings: GatewaySettings
    tokens: TokenStore
    scheduler: SchedulerClient
    agents: AgentClients
    store: Store
    limiter: TokenBuckets
    # Where the HTTP audit middleware, the TokenService and GET /v1/audit write and read (None: not recorded).
    audit: AuditLog | None = None
    # The checkpoint-store (None: no checkpoint_store_address; the checkpoint routes answer 503).
    checkpoints: CheckpointStoreClient | None = None
    # The read view of the live jobs (None: the job_view setting is off; every read asks the scheduler).
    job_view: JobView | None = None
    # GET /v1/fleet/metrics (fleet_metrics.py): the allocation the gateway records, every GPU's latest poll (None:
    # not kept; the answer's lists are empty).
    fleet_history: FleetHistory | None = None
    latest_gpus: LatestGpus | None = None


def deps_of(request: Request) -> GatewayDeps:
    """The app's dependencies, read in the route: the two reads the view answers (GET /v1/jobs/{id} and the
    list) take them so, since a FastAPI dependency level costs about a tenth of such a read (bench/gateway);
    the other routes declare `Deps`."""
    deps = request.app.state.deps
    assert isinstance(deps, GatewayDeps)
    return deps


async def get_deps(request: Request) -> GatewayDeps:
    # async, though it awaits nothing: FastAPI runs a plain `def` dependency in its thread pool, a thread hop
    # on every request (measured: the largest single cost of a GET answered from the read view).
    deps = request.app.state.deps
    assert isinstance(deps, GatewayDeps)
    return deps
