"""/healthz (no token): 200 when the scheduler and etcd answer, 503 with the reason otherwise."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response

from trainyard_core.errors import TrainyardError

from ..auth import Deps
from ..schemas.health import DependencyHealth, Health

router = APIRouter(tags=["health"])
CHECK_TIMEOUT_S = 2.0


async def _etcd(deps: Deps) -> DependencyHealth:
    try:
        await asyncio.wait_for(deps.store.get(deps.settings.etcd_prefix.rstrip("/") + "/gateway/health"),
                               CHECK_TIMEOUT_S)
    except (TrainyardError, TimeoutError) as exc:
        detail = exc.message if isinstance(exc, TrainyardError) else f"no answer within {CHECK_TIMEOUT_S}s"
        return DependencyHealth(reachable=False, detail=detail)
    return DependencyHealth(reachable=True, detail="")


async def _scheduler(deps: Deps) -> DependencyHealth:
    problem = await deps.scheduler.check_health(CHECK_TIMEOUT_S)
    return DependencyHealth(reachable=not problem, detail=(
        f"scheduler at {deps.settings.scheduler_address}: {problem}" if problem else ""))


@router.get("/healthz", response_model=Health, summary="Health of the gateway and what it depends on",
            responses={503: {"model": Health, "description": "the scheduler or etcd cannot be reached"}})
async def healthz(response: Response, deps: Deps) -> Health:
    scheduler, etcd = await asyncio.gather(_scheduler(deps), _etcd(deps))
    ok = scheduler.reachable and etcd.reachable
    response.status_code = 200 if ok else 503
    return Health(status="ok" if ok else "degraded", scheduler=scheduler, etcd=etcd)
