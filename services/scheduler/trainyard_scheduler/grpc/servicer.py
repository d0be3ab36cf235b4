"""Thin gRPC adapters: convert, call the domain/repository, convert back. Errors are domain errors,
mapped to status codes by the shared interceptor."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

import grpc.aio

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core import contract, telemetry
from trainyard_core.clock import Clock
from trainyard_core.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from trainyard_core.ids import is_valid_id, new_id
from trainyard_core.logs import log_context
from trainyard_core.rpc import pulse
from trainyard_core.rpc.audit import CallAudit
from trainyard_core.security import authz
from trainyard_core.store.api import WatchCompacted

from ..domain import listing, operations, pending
from ..domain.health import apply_gpu_health, cordon_for_health
from ..domain.jobs import request_cancel
from ..domain.models import Gpu, Job, JobState, Node
from ..domain.pending import PendingOrder
from ..domain.queues import DEFAULT_CLASSES
from ..domain.validation import (
    FleetFit,
    check_priority_class,
    check_queue,
    validate_spec,
    validate_team,
)
from ..history.access import History
from ..history.store import HistoryStore, HistoryUnavailable
from ..leadership import Leadership
from ..liveness import NodeLiveness
from ..pulses import PulseSessions
from ..state.codec import decode_allocation, decode_job
from ..state.policy_repository import PolicyRepository
from ..state.repository import ETCD_DEFAULT_MAX_TXN_OPS, IdempotentJobGone, Repository, max_gang_nodes
from . import convert
from .node_messages import NodeMessages, registration_shown
from .submit_batch import SubmitBatch
from .teams import acting_team

log = logging.getLogger(__name__)

DEFAULT_PAGE = contract.DEFAULT_PAGE_SIZE
MAX_PAGE = contract.MAX_PAGE_SIZE


def _running(running: Iterable[scheduler_pb2.RunningAllocation]) -> frozenset[tuple[str, int]]:
    return frozenset((r.job_id, r.attempt) for r in running)


def _request_digest(spec: types_pb2.JobSpec, user: str) -> str:
    """What an idempotency key is bound to: the spec as sent (deterministic encoding: maps in key order) and the
    user it is submitted as."""
    digest = hashlib.sha256(spec.SerializeToString(deterministic=True))
    digest.update(b"\0" + user.encode())
    return digest.hexdigest()[:32]


def _check_reason(reason: str) -> None:
    if len(reason) > contract.MAX_REASON_LENGTH:
        raise InvalidArgument(f"reason must be at most {contract.MAX_REASON_LENGTH} characters")


def _check_job_id(job_id: str) -> None:
    if not is_valid_id(job_id):
        raise InvalidArgument(f"job_id {job_id!r} is not a valid job id")


class JobServicer(scheduler_pb2_grpc.JobServiceServicer):
    """`priority_classes`: the class names a job may ask for (default: the built-in classes). `fleet`: the
    registered nodes (the replica's mirror of etcd; default: read from etcd at each submit). `policy`:
    where the queues are (default: the same store and keys as `repo`). `max_txn_ops`: the operations one
    store transaction may carry (etcd's --max-txn-ops, probed at start), which bounds the nodes of a gang."""

    def __init__(self, repo: Repository, clock: Clock, wake: asyncio.Event,
                 priority_classes: Collection[str] | None = None, policy: PolicyRepository | None = None,
                 max_txn_ops: int = ETCD_DEFAULT_MAX_TXN_OPS,
                 tool_teams: Mapping[str, frozenset[str]] | None = None,
                 fleet: Callable[[], Awaitable[Sequence[Node]]] | None = None, history: History | None = None,
                 leadership: Leadership | None = None, pending: Callable[[], PendingOrder] | None = None,
                 audit: CallAudit | None = None) -> None:
        # SubmitJobs: each item served as a SubmitJob, audited as one (`audit`: the server's audit log).
        self._batch = SubmitBatch(self._submit, audit)
        # The queue order, which only the leader has (its last cycle's; ListPending).
        self._leadership = leadership
        self._pending = pending
        self._max_gang_nodes = max_gang_nodes(max_txn_ops)
        # Finished jobs that have left etcd are read from here (None: no history store, they never leave).
        self._history = history
        # The registered nodes a submit is checked against (the app's mirror; default: read from etcd).
        self._fleet = fleet or repo.nodes.list
        self._fit = FleetFit()
        self._tool_teams = dict(tool_teams or {})
        self._repo = repo
        self._clock = clock
        self._wake = wake
        self._classes = frozenset(priority_classes if priority_classes is not None
                                  else (c.name for c in DEFAULT_CLASSES))
        self._policy = policy or PolicyRepository(repo.store, repo.keys)

    def _team(self, requested: str) -> str:
        """The team a call acts for (teams.acting_team: the gateway's users' team, a tool's bound teams)."""
        return acting_team(requested, self._tool_teams)

    def _user(self, requested: str) -> str:
        """Who submitted: the gateway names its user; a tool is its own user."""
        principal = authz.current_principal.get()
        if principal is not None and principal.kind == "tool":
            return f"tool:{principal.name}"
        return requested or "unknown"

    async def _visible(self, job_id: str, team: str) -> tuple[Job, int]:
        """The job and its etcd revision; a finished job that has left etcd comes from the history store,
        with revision 0."""
        team = self._team(team)
        _check_job_id(job_id)
        found = await self._repo.get_job(job_id) or await self._archived(job_id)
        if found is None or (team and found[0].team != team):
            raise NotFound(f"job {job_id} not found")
        return found

    async def _history_store(self) -> HistoryStore:
        assert self._history is not None
        try:
            return await self._history.store()
        except HistoryUnavailable as exc:
            raise Unavailable(f"finished jobs are read from the history store, which cannot be reached now: "
                              f"{exc}; retry") from None

    async def _archived(self, job_id: str) -> tuple[Job, int] | None:
        if self._history is None:
            return None
        store = await self._history_store()
        try:
            found = await store.get(job_id)
        except HistoryUnavailable as exc:
            raise Unavailable(f"the history store cannot be read now: {exc}; retry") from None
        return (decode_job(found.record), 0) if found is not None else None

    async def _view(self, job: Job) -> types_pb2.Job:
        alloc = None
        if not job.state.terminal and job.state is not JobState.PENDING:
            found = await self._repo.get_allocation(job.id)
            alloc = found[0] if found else None
            if alloc is None:
                # Released between the two reads: the job record has moved on too; show that one.
                again = await self._repo.get_job(job.id)
                job = again[0] if again else job
        return convert.job_to_pb(job, alloc)

    async def SubmitJob(self, request: scheduler_pb2.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.SubmitJobResponse:
        return await self._submit(request)

    async def SubmitJobs(self, request: scheduler_pb2.SubmitJobsRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.SubmitJobsResponse:
        return await self._batch(request, context)

    async def _submit(self, request: scheduler_pb2.SubmitJobRequest) -> scheduler_pb2.SubmitJobResponse:
        spec = convert.spec_from_pb(request.spec)
        validate_spec(spec)
        team = self._team(request.team) or "default"
        validate_team(team)
        if request.idempotency_key and not contract.IDEMPOTENCY_KEY.matches(request.idempotency_key):
            raise InvalidArgument(f"idempotency_key must be {contract.IDEMPOTENCY_KEY.rule}")
        check_priority_class(spec, self._classes)
        if spec.queue != "default":  # "default" always exists: no read for the common case
            check_queue(spec, await self._policy.queue_names())
        self._fit.check(spec, await self._fleet())
        if spec.resources.nodes > self._max_gang_nodes:
            raise FailedPrecondition(
                f"resources.nodes={spec.resources.nodes}: a gang is placed in one etcd transaction, which holds "
                f"at most {self._max_gang_nodes} nodes with this etcd's limit; an operator can raise it with "
                "etcd's --max-txn-ops (then restart the scheduler)")
        now = self._clock.now()
        job = Job(id=new_id("job", now), spec=spec, state=JobState.PENDING, team=team,
                  user=self._user(request.user), created_at=now, updated_at=now, queued_at=now,
                  message=operations.WAITING_MESSAGE, trace_parent=telemetry.traceparent())
        archived = False
        try:
            stored, created = await self._repo.create_job(job, request.idempotency_key,
                                                          _request_digest(request.spec, job.user))
        except IdempotentJobGone as gone:
            # The submit this key made has finished and left etcd: answer with it, from the history.
            earlier = await self._archived(gone.job_id)
            if earlier is None:
                raise Conflict(f"idempotency key {request.idempotency_key!r} names job {gone.job_id}, which is "
                               "neither in etcd nor in the history store; use a new key") from None
            stored, created, archived = earlier[0], False, True
        telemetry.tag({telemetry.JOB_ID: stored.id})
        if created:
            with log_context(job_id=stored.id):
                log.info("job submitted", extra={"team": team, "nodes": spec.resources.nodes,
                                                 "gpus_per_node": spec.resources.gpus_per_node})
            self._wake.set()
        # The revision a reader of the job watch must reach to see the job (the create's, or a later one): for
        # a job this call created, this replica's newest job create is at or after it, so no read is needed.
        if created:
            revision = self._repo.created_revision
        else:
            found = None if archived else await self._repo.get_job(stored.id)
            revision = found[1] if found else 0
        return scheduler_pb2.SubmitJobResponse(job=await self._view(stored), created=created, revision=revision)

    async def GetJob(self, request: scheduler_pb2.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.GetJobResponse:
        job, _ = await self._visible(request.job_id, request.team)
        return scheduler_pb2.GetJobResponse(job=await self._view(job))

    async def ListJobs(self, request: scheduler_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.ListJobsResponse:
        if request.page_size < 0 or request.page_size > MAX_PAGE:
            raise InvalidArgument(f"page_size must be between 1 and {MAX_PAGE} (0 means {DEFAULT_PAGE})")
        flt = convert.job_filter_from_pb(request, self._team(request.team))
        listing.check_filter(flt)
        before = listing.decode_token(request.page_token, flt)
        limit = request.page_size or DEFAULT_PAGE
        jobs, more = await self._repo.list_jobs(before=before, limit=limit,
                                                match=functools.partial(listing.matches, flt=flt))
        if self._history is not None and flt.needs_history:
            jobs, more = await self._with_archived(jobs, more, before=before, limit=limit, flt=flt)
        token = listing.encode_token(jobs[-1].id, flt) if more and jobs else ""
        return scheduler_pb2.ListJobsResponse(jobs=[convert.job_to_pb(j) for j in jobs], next_page_token=token)

    async def _with_archived(self, live: list[Job], more: bool, *, before: str, limit: int,
                             flt: listing.JobFilter) -> tuple[list[Job], bool]:
        """One page of the live jobs merged with the finished ones in the history store, newest first: each
        source gives its first `limit` below the cursor, so the first `limit` of their union are the page. A job
        in both (archived, not yet expired from etcd) is shown once, as etcd has it."""
        store = await self._history_store()
        terminal = frozenset(s for s in flt.states if JobState(s).terminal)
        try:
            found = await store.list(replace(flt, states=terminal), limit=limit, before=before)
        except HistoryUnavailable as exc:
            raise Unavailable(f"the history store cannot be read now: {exc}; retry") from None
        merged = {j.id: j for j in (decode_job(a.record) for a in found)}
        merged.update({j.id: j for j in live})
        page = [merged[k] for k in sorted(merged, reverse=True)]
        return page[:limit], more or len(found) == limit or len(page) > limit

    async def CancelJob(self, request: scheduler_pb2.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.CancelJobResponse:
        if len(request.reason) > contract.MAX_REASON_LENGTH:
            raise InvalidArgument(f"reason must be at most {contract.MAX_REASON_LENGTH} characters")
        for _ in range(10):
            job, rev = await self._visible(request.job_id, request.team)
            cancelled = request_cancel(job, self._clock.now(), request.reason, by=self._user(request.user))
            if cancelled is job:
                return scheduler_pb2.CancelJobResponse(job=await self._view(job), revision=rev)
            try:
                written = await self._repo.update_job(cancelled, rev)
            except Conflict:
                continue
            with log_context(job_id=job.id):
                log.info("cancel requested", extra={"state": cancelled.state.value, "user": cancelled.cancelled_by})
            self._wake.set()
            return scheduler_pb2.CancelJobResponse(job=await self._view(cancelled), revision=written)
        raise Conflict(f"job {request.job_id} kept changing; retry the cancel")

    async def HoldJob(self, request: scheduler_pb2.HoldJobRequest,
                      context: grpc.aio.ServicerContext) -> scheduler_pb2.HoldJobResponse:
        _check_reason(request.reason)
        by = self._user(request.user)
        job, revision = await self._operate(request.job_id, request.team, "hold",
                                  lambda j, now: operations.hold(j, now, by, request.reason))
        return scheduler_pb2.HoldJobResponse(job=job, revision=revision)

    async def ReleaseJob(self, request: scheduler_pb2.ReleaseJobRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.ReleaseJobResponse:
        by = self._user(request.user)
        job, revision = await self._operate(request.job_id, request.team, "release",
                                  lambda j, now: operations.release(j, now, by))
        return scheduler_pb2.ReleaseJobResponse(job=job, revision=revision)

    async def SetJobPriority(self, request: scheduler_pb2.SetJobPriorityRequest,
                             context: grpc.aio.ServicerContext) -> scheduler_pb2.SetJobPriorityResponse:
        by = self._user(request.user)
        job, revision = await self._operate(request.job_id, request.team, "priority change",
                                  lambda j, now: operations.set_priority(j, now, by, request.priority))
        return scheduler_pb2.SetJobPriorityResponse(job=job, revision=revision)

    async def RequeueJob(self, request: scheduler_pb2.RequeueJobRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.RequeueJobResponse:
        _check_reason(request.reason)
        by = self._user(request.user)
        job, revision = await self._operate(request.job_id, request.team, "requeue",
                                  lambda j, now: operations.request_requeue(j, now, by, request.reason))
        return scheduler_pb2.RequeueJobResponse(job=job, revision=revision)

    async def ListPending(self, request: scheduler_pb2.ListPendingRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.ListPendingResponse:
        team = self._team(request.team)
        if team:
            validate_team(team)
        if request.queue and not contract.QUEUE_NAME.matches(request.queue):
            raise InvalidArgument(f"queue must be {contract.QUEUE_NAME.rule}")
        if request.job_id:
            _check_job_id(request.job_id)
        limit = request.limit or contract.DEFAULT_PENDING_ROWS
        if not 1 <= limit <= contract.MAX_PENDING_ROWS:
            raise InvalidArgument(f"limit must be from 1 to {contract.MAX_PENDING_ROWS} (or 0 for "
                                  f"{contract.DEFAULT_PENDING_ROWS}), not {request.limit}")
        if self._leadership is None or self._pending is None:
            raise Unavailable("this scheduler replica keeps no queue order")
        self._leadership.require()
        order = self._pending()
        entries, total = pending.select(order, team=team, queue=request.queue, job_id=request.job_id, limit=limit)
        return convert.pending_to_pb(order, entries, total)

    async def _operate(self, job_id: str, team: str, what: str,
                       change: Callable[[Job, float], Job]) -> tuple[types_pb2.Job, int]:
        """Read the job, apply `change` (operations.py: it returns the job itself when there is nothing to do),
        CAS-write it and wake the leader; the job as it is now, and the etcd revision it was read or written at."""
        for _ in range(10):
            job, rev = await self._visible(job_id, team)
            changed = change(job, self._clock.now())
            if changed is job:
                return await self._view(job), rev
            if rev == 0:  # read from the history store: finished, so no operation changes it
                raise FailedPrecondition(f"job {job_id} has finished and left etcd; it cannot change")
            try:
                written = await self._repo.update_job(changed, rev)
            except Conflict:
                continue
            with log_context(job_id=job.id):
                log.info("job %s", what, extra={"event": changed.events[-1].message if changed.events else ""})
            self._wake.set()
            return await self._view(changed), written
        raise Conflict(f"job {job_id} kept changing; retry the {what}")

    async def WatchJob(self, request: scheduler_pb2.WatchJobRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.WatchJobResponse]:
        job, rev = await self._visible(request.job_id, request.team)
        yield scheduler_pb2.WatchJobResponse(job=await self._view(job))
        key = self._repo.keys.job(job.id)
        start = rev + 1
        while not job.state.terminal:
            try:
                async for batch in self._repo.store.watch(key, start_revision=start):
                    for ev in batch:
                        if ev.key != key or ev.mod_revision <= rev:
                            continue
                        if ev.kind == "delete":
                            return
                        job, rev = decode_job(ev.value), ev.mod_revision
                        yield scheduler_pb2.WatchJobResponse(job=await self._view(job))
                        if job.state.terminal:
                            return
                return
            except WatchCompacted as compacted:
                # etcd compacted the revisions after the one last seen (a job unchanged for longer than the
                # auto-compaction window): read the job again (the read is at or after the compaction, so it
                # holds any change up to it), show it if it moved, and watch on from after the compaction.
                start = max(compacted.compacted_revision + 1, rev + 1)
                found = await self._repo.get_job(job.id)
                if found is None:
                    return  # finished and archived meanwhile: the caller reads the end with GetJob
                if found[1] != rev:
                    job, rev = found
                    yield scheduler_pb2.WatchJobResponse(job=await self._view(job))


class NodeServicer(scheduler_pb2_grpc.NodeServiceServicer):
    def __init__(self, repo: Repository, leadership: Leadership, liveness: NodeLiveness, clock: Clock,
                 heartbeat_interval_ms: int, *, worker_fence_s: float = 0.0,
                 pulses: PulseSessions | None = None, registered: Callable[[str], bool] | None = None,
                 fleet: Callable[[], Awaitable[Sequence[Node]]] | None = None) -> None:
        self._repo = repo
        # Where ListNodes reads the registered nodes (the leader's mirror; etcd by default), and their messages.
        self._fleet = fleet or repo.nodes.list
        self._messages = NodeMessages()
        # Whether this replica's mirror holds the node's record: a stream's first beat then needs no etcd read
        # to know its node is registered (every agent opens its stream right after registering; after a
        # failover, thousands at once).
        self._registered = registered
        # Liveness pulse sessions, one per stream that asks (None: this replica offers none).
        self._pulses = pulses
        self._worker_fence_s = worker_fence_s
        self._leadership = leadership
        self._liveness = liveness
        self._clock = clock
        self._interval = heartbeat_interval_ms
        self._last_heartbeat: dict[str, float] = {}
        # When each node last registered with this replica (the stored record keeps the time it last changed).
        self._registered_at: dict[str, float] = {}
        # GPU health changes received but not yet written (the store was unavailable), per node.
        self._pending_health: dict[str, dict[int, Gpu]] = {}
        # One future per open heartbeat stream, completed when this replica's term ends (`end_streams`).
        self._term_ends: set[asyncio.Future[None]] = set()

    async def RegisterNode(self, request: scheduler_pb2.RegisterNodeRequest,
                           context: grpc.aio.ServicerContext) -> scheduler_pb2.RegisterNodeResponse:
        epoch = self._leadership.require()
        if not is_valid_id(request.node.node_id):
            raise InvalidArgument(f"node_id {request.node.node_id!r} must be 3-63 lower-case letters, digits "
                                  "or '-', starting with a letter")
        fresh = convert.node_from_pb(request.node, self._clock.now())

        def merge(old: Node | None) -> Node:
            # Cordon is the operator's (or the health policy's), not the agent's to lift.
            kept = fresh if old is None else replace(fresh, cordoned=old.cordoned, cordon_reason=old.cordon_reason)
            kept = cordon_for_health(kept)
            # An agent that registers again with what is stored (a reconnect, a failover: every agent at
            # once) costs no etcd write; the registration time is kept in memory for the views.
            if old is not None and replace(kept, registered_at=old.registered_at) == old:
                return old
            return kept
        old, written = await self._repo.nodes.modify(fresh.node_id, merge, mirror_first=True)
        node = written or merge(old)
        self._registered_at[node.node_id] = fresh.registered_at
        if node.cordoned and (old is None or not old.cordoned):
            with log_context(node_id=node.node_id):
                log.warning("node cordoned by the health policy", extra={"reason": node.cordon_reason})
        self._liveness.seen(node.node_id)
        self._liveness.reports.report(node.node_id, _running(request.running))
        self._last_heartbeat[node.node_id] = self._clock.now()
        with log_context(node_id=node.node_id):
            log.info("node registered", extra={"gpus": len(node.gpus), "agent": node.agent_address})
        return scheduler_pb2.RegisterNodeResponse(node_id=node.node_id, heartbeat_interval_ms=self._interval,
                                                  leader_epoch=epoch, worker_fence_s=self._worker_fence_s)

    async def Heartbeat(self, request_iterator: AsyncIterator[scheduler_pb2.HeartbeatRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.HeartbeatResponse]:
        """The stream carries the node's changes (a beat on each, and a slow refresh); its first answer opens a
        pulse session when the agent asks, and the pulses are then the node's liveness (liveness.py, pulses.py).
        Liveness is noted before anything touches etcd, and an etcd failure (a leader change, a lost member)
        never ends the stream: a node must not look lost because the store hiccupped. Health changes that
        could not be written are kept and written with a later beat. The stream ends when this replica's
        term does (`end_streams`), so agents look for the new leader at once."""
        self._leadership.require()
        term_over = self._term_over()
        node_id = ""
        clean = False
        session, key = 0, b""
        known: set[str] = set()  # read once per stream: a node whose record is gone is asked to register
        requests = request_iterator.__aiter__()
        nxt: asyncio.Future[scheduler_pb2.HeartbeatRequest] | None = None
        try:
            while True:
                # The next beat, or the end of this replica's term, whichever comes first. (Cancelling the
                # handler's task instead would leave the RPC open without a status.)
                nxt = asyncio.ensure_future(requests.__anext__())
                await asyncio.wait((nxt, term_over), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    self._leadership.require()  # raises NotLeader: the agent looks for the new leader
                    raise Unavailable("this scheduler replica's term ended; register with the leader")
                try:
                    req = nxt.result()
                except StopAsyncIteration:
                    clean = True
                    return
                first = not node_id
                if first:
                    if not is_valid_id(req.node_id):
                        raise InvalidArgument(f"node_id {req.node_id!r} is not a valid node id")
                    node_id = req.node_id
                    if req.pulses and self._pulses is not None:
                        session, key = self._pulses.open(node_id)
                    self._liveness.opened(node_id, pulsed=bool(session))
                elif req.node_id != node_id:
                    raise InvalidArgument(f"one heartbeat stream carries one node: it began as {node_id!r}, "
                                          f"not {req.node_id!r}")
                answer = await self._beat(req, known)
                if first and session:
                    answer.pulse_session, answer.pulse_key = session, key
                    answer.pulse_interval_ms = round(pulse.PULSE_INTERVAL_S * 1000)
                yield answer
                if answer.reregister:
                    clean = True
                    return
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()  # the call ended (the agent went away, or grpc cancelled it) while a read waited
            self._term_ends.discard(term_over)
            if session and self._pulses is not None:
                self._pulses.close(session)
            if node_id:
                self._liveness.closed(node_id, clean=clean, pulsed=bool(session))
                self._last_heartbeat[node_id] = self._clock.now()

    async def Beat(self, request: scheduler_pb2.HeartbeatRequest,
                   context: grpc.aio.ServicerContext) -> scheduler_pb2.HeartbeatResponse:
        """One beat as one call (the connectionless path: the agent holds no connection between beats, so the
        leader holds none per node). The first beat after a registration opens the node's pulse session (its
        only one: a session it held before is closed); later beats name it, and a beat naming a session this
        replica does not hold is told to register again (a new leader, or a session replaced). A leaving beat
        ends the session. Unlike a stream's beat, one whose GPU health could not be stored fails UNAVAILABLE:
        the agent sends it again (no later refresh would come soon)."""
        epoch = self._leadership.require()
        node_id = request.node_id
        if not is_valid_id(node_id):
            raise InvalidArgument(f"node_id {node_id!r} is not a valid node id")
        pulses, session = self._pulses, request.pulse_session
        if request.leaving:
            if session and pulses is not None and pulses.holds(session, node_id):
                pulses.close(session)
                self._liveness.left(node_id)
                self._last_heartbeat[node_id] = self._clock.now()
            return scheduler_pb2.HeartbeatResponse(ack_seq=request.seq, leader_epoch=epoch)
        if session and (pulses is None or not pulses.holds(session, node_id)):
            return scheduler_pb2.HeartbeatResponse(ack_seq=request.seq, leader_epoch=epoch, reregister=True)
        answer = await self._beat(request, set())
        if answer.reregister:
            return answer
        if not session and request.pulses and pulses is not None:
            answer.pulse_session, answer.pulse_key = pulses.open(node_id, sole=True)
            answer.pulse_interval_ms = round(pulse.PULSE_INTERVAL_S * 1000)
            self._liveness.pulsing(node_id)
        if node_id in self._pending_health:
            raise Unavailable(f"the GPU health of node {node_id} could not be stored yet (the store is "
                              "unavailable); send the beat again")
        return answer

    async def _beat(self, req: scheduler_pb2.HeartbeatRequest,
                    known: set[str]) -> scheduler_pb2.HeartbeatResponse:
        epoch = self._leadership.require()
        if req.node_id not in known and self._registered is not None and self._registered(req.node_id):
            known.add(req.node_id)
        if req.node_id not in known:
            try:
                await self._repo.nodes.get(req.node_id)
                known.add(req.node_id)
            except NotFound:
                return scheduler_pb2.HeartbeatResponse(ack_seq=req.seq, leader_epoch=epoch, reregister=True)
            except Unavailable as exc:
                # Unknown for now whether it is registered; it talks to us, so it is alive.
                log.warning("heartbeat: node lookup failed, store unavailable: %s", exc,
                            extra={"node_id": req.node_id})
        self._liveness.seen(req.node_id)
        self._liveness.reports.report(req.node_id, _running(req.running))
        self._last_heartbeat[req.node_id] = self._clock.now()
        if req.gpus:
            pending = self._pending_health.setdefault(req.node_id, {})
            pending.update({g.index: convert.gpu_from_pb(g) for g in req.gpus})
        if req.node_id in self._pending_health and req.node_id in known:
            try:
                await self._update_health(req.node_id, self._pending_health[req.node_id])
                del self._pending_health[req.node_id]
            except (Unavailable, Conflict) as exc:
                log.warning("GPU health not written yet (retried with the next heartbeat): %s", exc,
                            extra={"node_id": req.node_id})
        return scheduler_pb2.HeartbeatResponse(ack_seq=req.seq, leader_epoch=epoch)

    def end_streams(self) -> None:
        """This replica's term ended: end every heartbeat stream (agents reconnect and find the new leader;
        until they do, their workers' fence runs down) and drop health changes not yet written (the agents
        send them again when they register)."""
        for ended in self._term_ends:
            if not ended.done():
                ended.set_result(None)
        self._term_ends.clear()
        self._pending_health.clear()
        if self._pulses is not None:
            self._pulses.clear()

    def _term_over(self) -> asyncio.Future[None]:
        """A future of the calling stream's own that the end of this term completes. Not one shared by every
        stream: each beat waits on it with asyncio.wait, which adds a callback and then removes it by a linear
        scan of the future's callbacks, so a shared one cost every beat a walk over every open stream
        (quadratic in the fleet: a tenth of the leader's CPU at 3,000 nodes, bench/fleet)."""
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._term_ends.add(ended)
        return ended

    def _registration(self, node: Node) -> Node:
        at = registration_shown(node, self._registered_at.get(node.node_id))
        return node if at == node.registered_at else replace(node, registered_at=at)

    def last_heartbeat(self, node_id: str) -> float | None:
        """Wall-clock time of the node's last proof of life: now while its stream is open, else its last pulse
        or beat."""
        if self._liveness.connected(node_id):
            return self._clock.now()
        age = self._liveness.last_seen_age(node_id)
        if age is not None:
            return self._clock.now() - age
        return self._last_heartbeat.get(node_id)

    async def _update_health(self, node_id: str, changed: dict[int, Gpu]) -> None:
        def health(stored: Node | None) -> Node:
            if stored is None:
                raise NotFound(f"node {node_id} is not registered")
            return apply_gpu_health(stored, changed)
        node, updated = await self._repo.nodes.modify(node_id, health)
        if node is not None and updated is not None:
            with log_context(node_id=node.node_id):
                log.warning("GPU health changed", extra={
                    "unhealthy": sorted(updated.unhealthy_gpus()),
                    "reasons": {g.index: g.health_reason for g in updated.gpus if not g.healthy}})
                if updated.cordoned and not node.cordoned:
                    log.warning("node cordoned by the health policy", extra={"reason": updated.cordon_reason})

    async def ReportWorkerExit(self, request: scheduler_pb2.ReportWorkerExitRequest,
                               context: grpc.aio.ServicerContext) -> scheduler_pb2.ReportWorkerExitResponse:
        self._leadership.require()
        _check_job_id(request.job_id)
        exit = convert.exit_from_pb(request.exit, request.node_id or request.exit.node_id, self._clock.now())
        with log_context(job_id=request.job_id, node_id=exit.node_id):
            recorded = await self._repo.exits.record(request.job_id, request.attempt, exit)
            log.info("worker exited", extra={"rank": exit.rank, "exit_code": exit.exit_code,
                                             "signal": exit.signal, "recorded": recorded})
        return scheduler_pb2.ReportWorkerExitResponse()

    async def ListNodes(self, request: scheduler_pb2.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.ListNodesResponse:
        self._leadership.require()  # only the leader hears heartbeats: a standby's view says nothing
        nodes = await self._fleet()
        used = await self._used_gpus()
        return self._messages.listing(nodes, alive=self._liveness.alive(n.node_id for n in nodes), allocated=used,
                                      last_heartbeat=self.last_heartbeat, registered_at=self._registered_at)

    async def GetNode(self, request: scheduler_pb2.GetNodeRequest,
                      context: grpc.aio.ServicerContext) -> scheduler_pb2.GetNodeResponse:
        self._leadership.require()
        node = await self._repo.nodes.get(request.node_id)
        used = await self._used_gpus()
        alive = node.node_id in self._liveness.alive([node.node_id])
        return scheduler_pb2.GetNodeResponse(node=convert.node_to_pb(
            self._registration(node), alive=alive, allocated=used.get(node.node_id, set()),
            last_heartbeat=self.last_heartbeat(node.node_id)))

    async def CordonNode(self, request: scheduler_pb2.CordonNodeRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.CordonNodeResponse:
        self._leadership.require()
        if len(request.reason) > contract.MAX_REASON_LENGTH:
            raise InvalidArgument(f"reason must be at most {contract.MAX_REASON_LENGTH} characters")
        def cordon(stored: Node | None) -> Node:
            if stored is None:
                raise NotFound(f"node {request.node_id} is not registered")
            return replace(stored, cordoned=request.cordoned,
                           cordon_reason=(request.reason or "cordoned by an operator") if request.cordoned else "")
        old, written = await self._repo.nodes.modify(request.node_id, cordon)
        node = written or cordon(old)
        with log_context(node_id=node.node_id):
            log.info("node cordon changed", extra={"cordoned": node.cordoned, "reason": request.reason})
        got = await self.GetNode(scheduler_pb2.GetNodeRequest(node_id=node.node_id), context)
        return scheduler_pb2.CordonNodeResponse(node=got.node)

    async def _used_gpus(self) -> dict[str, set[int]]:
        page = await self._repo.store.range(self._repo.keys.allocations)
        used: dict[str, set[int]] = {}
        for kv in page.kvs:
            for a in decode_allocation(kv.value).assignments:
                used.setdefault(a.node_id, set()).update(a.gpu_indices)
        return used
