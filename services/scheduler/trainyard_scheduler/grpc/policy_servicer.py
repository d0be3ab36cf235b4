"""PolicyService: queues and team quotas. Thin: check names, convert, call the policy repository (which
validates the records), convert back. Errors are domain errors, mapped by the shared interceptor.
Who may call what (admins change, teams read their own quota) is the gateway's to enforce.

A quota read (List, Get, and the answer of Put) carries what the team's gangs hold now under each quota key
(`domain.quota_use`), from `holdings`: the allocations in this replica's mirror, at one revision."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import grpc.aio

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import policy_pb2, policy_pb2_grpc
from trainyard_core.errors import InvalidArgument, NotFound

from ..domain.models import Allocation
from ..domain.queues import NAME_RE, TeamQuota
from ..domain.quota_use import quota_use
from ..domain.validation import TEAM_RE
from ..state.policy_repository import PolicyRepository
from . import convert

log = logging.getLogger(__name__)


def _check_queue_name(name: str, field: str = "name") -> None:
    if not NAME_RE.match(name):
        raise InvalidArgument(f"{field} {name[:80]!r} must be 1-63 letters, digits, '.', '_' or '-', starting with "
                              "a letter or digit")


def _check_team(team: str, field: str = "team") -> None:
    if not TEAM_RE.match(team):
        raise InvalidArgument(f"{field} {team[:80]!r} must be 1-63 lower-case letters, digits or '-'")


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    """`wake` (optional) is set after every change, so a leader on this replica places with the new
    policy without waiting for its next cycle."""

    def __init__(self, repo: PolicyRepository, wake: asyncio.Event | None = None,
                 holdings: Callable[[], Iterable[Allocation]] = tuple) -> None:
        self._repo = repo
        self._wake = wake
        self._holdings = holdings

    def _with_use(self, quotas: list[TeamQuota]) -> list[types_pb2.TeamQuota]:
        held = list(self._holdings()) if quotas else []
        out = []
        for quota in quotas:
            pb = convert.quota_to_pb(quota)
            for key, use in quota_use(quota.team, quota, held).items():
                pb.use[key].in_use = use.in_use
                pb.use[key].borrowed = use.borrowed
            out.append(pb)
        return out

    def _changed(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def ListQueues(self, request: policy_pb2.ListQueuesRequest,
                         context: grpc.aio.ServicerContext) -> policy_pb2.ListQueuesResponse:
        return policy_pb2.ListQueuesResponse(queues=[convert.queue_to_pb(q) for q in await self._repo.list_queues()])

    async def PutQueue(self, request: policy_pb2.PutQueueRequest,
                       context: grpc.aio.ServicerContext) -> policy_pb2.PutQueueResponse:
        _check_queue_name(request.queue.name, "queue.name")
        queue = convert.queue_from_pb(request.queue)
        created = await self._repo.put_queue(queue)
        log.info("queue stored", extra={"queue": queue.name, "was_created": created, "tier": queue.tier,
                                        "max_gpus": queue.max_gpus, "node_labels": dict(queue.node_labels)})
        self._changed()
        return policy_pb2.PutQueueResponse(queue=convert.queue_to_pb(queue), created=created)

    async def DeleteQueue(self, request: policy_pb2.DeleteQueueRequest,
                          context: grpc.aio.ServicerContext) -> policy_pb2.DeleteQueueResponse:
        _check_queue_name(request.name)
        queue = await self._repo.delete_queue(request.name)
        log.info("queue deleted", extra={"queue": queue.name})
        self._changed()
        return policy_pb2.DeleteQueueResponse(queue=convert.queue_to_pb(queue))

    async def ListQuotas(self, request: policy_pb2.ListQuotasRequest,
                         context: grpc.aio.ServicerContext) -> policy_pb2.ListQuotasResponse:
        if request.team:
            _check_team(request.team)
        quotas = await self._repo.list_quotas(request.team)
        return policy_pb2.ListQuotasResponse(quotas=self._with_use(quotas))

    async def GetQuota(self, request: policy_pb2.GetQuotaRequest,
                       context: grpc.aio.ServicerContext) -> policy_pb2.GetQuotaResponse:
        _check_team(request.team)
        quota = await self._repo.get_quota(request.team)
        if quota is None:
            raise NotFound(f"team {request.team} has no quota (without one, everything it runs is borrowed "
                           "idle capacity)")
        return policy_pb2.GetQuotaResponse(quota=self._with_use([quota])[0])

    async def PutQuota(self, request: policy_pb2.PutQuotaRequest,
                       context: grpc.aio.ServicerContext) -> policy_pb2.PutQuotaResponse:
        _check_team(request.quota.team, "quota.team")
        quota = convert.quota_from_pb(request.quota)
        created = await self._repo.put_quota(quota)
        log.info("quota stored", extra={"team": quota.team, "was_created": created, "weight": quota.weight,
                                        "limits": {m: [x.nominal, x.borrow_limit] for m, x in quota.limits.items()}})
        self._changed()
        return policy_pb2.PutQuotaResponse(quota=self._with_use([quota])[0], created=created)

    async def DeleteQuota(self, request: policy_pb2.DeleteQuotaRequest,
                          context: grpc.aio.ServicerContext) -> policy_pb2.DeleteQuotaResponse:
        _check_team(request.team)
        quota = await self._repo.delete_quota(request.team)
        log.info("quota deleted", extra={"team": quota.team})
        self._changed()
        return policy_pb2.DeleteQuotaResponse(quota=convert.quota_to_pb(quota))
