"""Who may call which RPC: the one authorization table, and the interceptor every server installs.

A call is authorized on the principal of the caller's verified certificate (`identity.py`), never on what
the request says about its sender. Methods absent from the table are refused (default deny); a test holds
the table to every method of every service in proto/.

Some rules bind the request to the caller: a node principal may register, heartbeat or report exits only
for the node its certificate names (`as_node`: the request's node id, checked on every message of a
stream). Rules with `as_job` name the job a request acts on (its id, or a checkpoint id the callee resolves):
the server's `JobBinding` decides on every message whether the caller may act on that job (the
checkpoint-store's: a job credential only on its own job and attempt, the gateway and tools only on their
team's jobs). Other team binding (the gateway's users, a tool's teams) is the callee's: the interceptor puts
the principal in `current_principal` for the servicer.

The refusals: a client without a certificate of this deployment's CA does not get past the TLS handshake
(it sees UNAVAILABLE); UNAUTHENTICATED when its certificate names no trainyard:// principal (or on a
plaintext channel to this interceptor); PERMISSION_DENIED naming the principal and the method otherwise.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import grpc.aio

from ..errors import PermissionDenied, Unauthenticated
from .identity import Kind, Principal
from .tls import PeerIdentity, peer_identity


@dataclass(frozen=True, slots=True)
class JobRef:
    """The job a request acts on: `job_id`, or `checkpoint_id` (the callee resolves it to its job); the one the
    request's message has (None: not a field of it; "" when the request left it empty). `attempt`: the
    attempt the request says it speaks for (BeginCheckpoint). `same_attempt`: the call changes a checkpoint,
    which must then be one its caller's attempt began (Commit, Abort)."""

    job_id: str | None = None
    checkpoint_id: str | None = None
    attempt: int | None = None
    same_attempt: bool = False


class JobBinding(Protocol):
    """A server's check of `as_job` rules: may `caller` act on the job `ref` names? Raises PermissionDenied,
    NotFound (another team's job looks absent) or InvalidArgument (a malformed id or team header)."""

    async def bind(self, caller: PeerIdentity, method: str, ref: JobRef, metadata: Mapping[str, str]) -> None: ...


@dataclass(frozen=True, slots=True)
class Rule:
    allow: frozenset[Kind]
    # For node principals: the node id a request speaks for; it must be the certificate's node.
    as_node: Callable[[Any], str] | None = None
    # For calls on one job's data: the job the request names, checked by the server's JobBinding (for every
    # caller; a server without one admits no job principal to such a rule).
    as_job: Callable[[Any], JobRef] | None = None


def rule(*kinds: Kind, as_node: Callable[[Any], str] | None = None,
         as_job: Callable[[Any], JobRef] | None = None) -> Rule:
    return Rule(frozenset(kinds), as_node, as_job)


def _methods(service: str, names: Iterable[str], r: Rule) -> dict[str, Rule]:
    return {f"/{service}/{name}": r for name in names}


AGENT = "trainyard.agent.v1.AgentService"
JOBS = "trainyard.scheduler.v1.JobService"
NODES = "trainyard.scheduler.v1.NodeService"
POLICY = "trainyard.scheduler.v1.PolicyService"
USAGE = "trainyard.scheduler.v1.UsageService"
AUDIT = "trainyard.scheduler.v1.AuditService"
CHECKPOINTS = "trainyard.checkpoint.v1.CheckpointService"
TOKENS = "trainyard.gateway.v1.TokenService"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"

# Every principal that serves or operates; job credentials reach only the checkpoint-store's job methods.
ANY: tuple[Kind, ...] = ("scheduler", "gateway", "checkpoint-store", "node", "tool")
_CKPT_ADMIN: tuple[Kind, ...] = ("gateway", "scheduler", "tool")
_CKPT_WORKER: tuple[Kind, ...] = (*_CKPT_ADMIN, "job")


def _job_ref(request: Any) -> JobRef:
    return JobRef(job_id=request.job_id)


def _checkpoint_ref(request: Any) -> JobRef:
    return JobRef(checkpoint_id=request.checkpoint_id)


# The table. Read it as: method ← the principals that may call it.
RULES: Mapping[str, Rule] = {
    # Agents run what the scheduler says, and nothing else: launch, stop, fence (an epoch travels only here).
    **_methods(AGENT, ("LaunchWorkers", "StopWorkers", "RenewJobCredential"), rule("scheduler")),
    # The gateway's log follow asks whether an attempt's workers have ended when an agent's stream ends.
    **_methods(AGENT, ("ListWorkers",), rule("scheduler", "gateway", "tool")),
    # Logs go to users through the gateway (which checks the user's team); operators' tools read them too.
    **_methods(AGENT, ("GetWorkerLogs", "StreamWorkerLogs"), rule("gateway", "scheduler", "tool")),
    # Operator actions on a GPU arrive through the gateway (the operator's user is recorded there).
    **_methods(AGENT, ("SetGpuHealth",), rule("gateway", "tool")),
    # GPU telemetry and health history: the gateway (its console and API) and operators' tools.
    **_methods(AGENT, ("GetGpuMetrics",), rule("gateway", "tool")),
    # Fault injection is a test and drill facility: tools only.
    **_methods(AGENT, ("InjectFault",), rule("tool")),
    # A node speaks only for itself.
    f"/{NODES}/RegisterNode": rule("node", as_node=lambda r: str(r.node.node_id)),
    f"/{NODES}/Heartbeat": rule("node", as_node=lambda r: str(r.node_id)),
    f"/{NODES}/Beat": rule("node", as_node=lambda r: str(r.node_id)),
    f"/{NODES}/ReportWorkerExit": rule("node", as_node=lambda r: str(r.node_id)),
    **_methods(NODES, ("ListNodes", "GetNode", "CordonNode"), rule("gateway", "tool")),
    # Jobs and policy: the gateway (for its users) and tools bound to teams by the scheduler's settings.
    **_methods(JOBS, ("SubmitJob", "GetJob", "ListJobs", "CancelJob", "WatchJob", "HoldJob", "ReleaseJob",
                      "SetJobPriority", "RequeueJob", "ListPending"), rule("gateway", "tool")),
    # The gateway's batches of its users' submits (each item is checked and audited as a SubmitJob: BATCHES).
    f"/{JOBS}/SubmitJobs": rule("gateway"),
    # Every team's live jobs, for the gateway's read view (which scopes them to its users' teams itself).
    "/trainyard.scheduler.v1.JobWatchService/WatchJobs": rule("gateway"),
    **_methods(POLICY, ("ListQueues", "PutQueue", "DeleteQueue", "ListQuotas", "GetQuota", "PutQuota",
                        "DeleteQuota"), rule("gateway", "tool")),
    # Usage and cost: the gateway (its users' team, or every team for operators) and tools (their teams).
    f"/{USAGE}/GetUsage": rule("gateway", "tool"),
    # The audit log spans every team: only the gateway, for its operators (GET /v1/audit checks the role).
    f"/{AUDIT}/ListAuditEntries": rule("gateway"),
    # Checkpoints: a job's workers (its credential, for its own job and attempt only) call what the checkpoint
    # client uses; the gateway (users) and tools act on their team's jobs (x-trainyard-team); the scheduler on
    # any job. Bound by the checkpoint-store's JobBinding (trainyard_checkpoint/access.py).
    f"/{CHECKPOINTS}/BeginCheckpoint": rule(*_CKPT_WORKER, as_job=lambda r: JobRef(job_id=r.job_id,
                                                                                   attempt=r.attempt)),
    **_methods(CHECKPOINTS, ("CommitCheckpoint", "AbortCheckpoint"),
               rule(*_CKPT_WORKER, as_job=lambda r: JobRef(checkpoint_id=r.checkpoint_id, same_attempt=True))),
    **_methods(CHECKPOINTS, ("GetCheckpoint", "ReportDamaged", "AcquireRestoreLease", "RenewRestoreLease",
                             "ReleaseRestoreLease"), rule(*_CKPT_WORKER, as_job=_checkpoint_ref)),
    **_methods(CHECKPOINTS, ("ListCheckpoints", "GetLatestCheckpoint"), rule(*_CKPT_WORKER, as_job=_job_ref)),
    **_methods(CHECKPOINTS, ("DeleteCheckpoint", "TagCheckpoint", "UntagCheckpoint"),
               rule(*_CKPT_ADMIN, as_job=_checkpoint_ref)),
    **_methods(CHECKPOINTS, ("SetRetention", "GetRetention"), rule(*_CKPT_ADMIN, as_job=_job_ref)),
    # A pass over every team's checkpoints: operators' tools and the scheduler, not one team's user.
    f"/{CHECKPOINTS}/RunGc": rule("scheduler", "tool"),
    **_methods(TOKENS, ("CreateToken", "ListTokens", "RevokeToken"), rule("tool")),
    # Probes: any principal of this deployment.
    **_methods(HEALTH, ("Check", "Watch"), rule(*ANY)),
    **_methods(REFLECTION, ("ServerReflectionInfo",), rule("tool")),
}


@dataclass(frozen=True, slots=True)
class Audited:
    """A mutating RPC, recorded in the audit log (trainyard_core.audit) by the audit interceptor.

    `target` names what the call acts on, `<kind>/<id>`, from the request, or from the answer where only
    the answer knows (a submit's job id; None when the call failed). `team` is the team the request acts
    for, when it names one. `detail` is a few small fields: never the env, command or spec of a job, never a
    token's secret."""

    target: Callable[[Any, Any | None], str]
    team: Callable[[Any], str] | None = None
    detail: Callable[[Any], Mapping[str, object]] | None = None


def _on(kind: str, read: Callable[[Any], object]) -> Callable[[Any, Any | None], str]:
    def target(request: Any, _response: Any | None) -> str:
        value = str(read(request))
        return f"{kind}/{value}" if value else ""
    return target


def _answered(kind: str, read: Callable[[Any], object]) -> Callable[[Any, Any | None], str]:
    def target(_request: Any, response: Any | None) -> str:
        value = str(read(response)) if response is not None else ""
        return f"{kind}/{value}" if value else ""
    return target


_CHECKPOINT = _on("checkpoint", lambda r: r.checkpoint_id)
_GPU = _on("gpu", lambda r: r.gpu_index)

# Which calls change something, and what they act on. Reads (Get*, List*, Watch*, Stream*, Check) are not
# audited, nor is Heartbeat: liveness, many per second per node, not an action (LIVENESS). A test holds
# this table to every RPC in proto/.
AUDITED: Mapping[str, Audited] = {
    f"/{JOBS}/SubmitJob": Audited(_answered("job", lambda r: r.job.id), team=lambda r: r.team,
                                  detail=lambda r: {"name": r.spec.name, "user": r.user}),
    f"/{JOBS}/CancelJob": Audited(_on("job", lambda r: r.job_id), team=lambda r: r.team,
                                  detail=lambda r: {"reason": r.reason} if r.reason else {}),
    f"/{JOBS}/HoldJob": Audited(_on("job", lambda r: r.job_id), team=lambda r: r.team,
                                detail=lambda r: {"user": r.user, **({"reason": r.reason} if r.reason else {})}),
    f"/{JOBS}/ReleaseJob": Audited(_on("job", lambda r: r.job_id), team=lambda r: r.team,
                                   detail=lambda r: {"user": r.user}),
    f"/{JOBS}/SetJobPriority": Audited(_on("job", lambda r: r.job_id), team=lambda r: r.team,
                                       detail=lambda r: {"user": r.user, "priority": r.priority}),
    f"/{JOBS}/RequeueJob": Audited(_on("job", lambda r: r.job_id), team=lambda r: r.team,
                                   detail=lambda r: {"user": r.user, **({"reason": r.reason} if r.reason else {})}),
    f"/{NODES}/RegisterNode": Audited(_on("node", lambda r: r.node.node_id),
                                      detail=lambda r: {"agent_address": r.node.agent_address}),
    f"/{NODES}/ReportWorkerExit": Audited(_on("job", lambda r: r.job_id),
                                          detail=lambda r: {"node": r.node_id, "attempt": r.attempt}),
    f"/{NODES}/CordonNode": Audited(_on("node", lambda r: r.node_id),
                                    detail=lambda r: {"cordoned": r.cordoned, "reason": r.reason}),
    f"/{POLICY}/PutQueue": Audited(_on("queue", lambda r: r.queue.name)),
    f"/{POLICY}/DeleteQueue": Audited(_on("queue", lambda r: r.name)),
    f"/{POLICY}/PutQuota": Audited(_on("team", lambda r: r.quota.team), team=lambda r: r.quota.team),
    f"/{POLICY}/DeleteQuota": Audited(_on("team", lambda r: r.team), team=lambda r: r.team),
    f"/{AGENT}/LaunchWorkers": Audited(_on("job", lambda r: r.job_id), detail=lambda r: {
        "attempt": r.attempt, "workers": len(r.workers), "leader_epoch": r.leader_epoch}),
    f"/{AGENT}/StopWorkers": Audited(_on("job", lambda r: r.job_id), detail=lambda r: {
        "attempt": r.attempt, "reason": r.reason, "leader_epoch": r.leader_epoch}),
    f"/{AGENT}/RenewJobCredential": Audited(_on("job", lambda r: r.job_id), detail=lambda r: {
        "attempt": r.attempt, "leader_epoch": r.leader_epoch}),
    f"/{AGENT}/SetGpuHealth": Audited(_GPU, detail=lambda r: {"healthy": r.healthy, "operator": r.operator,
                                                              "reason": r.reason}),
    f"/{AGENT}/InjectFault": Audited(_GPU, detail=lambda r: {"kind": r.kind, "xid": r.xid}),
    f"/{CHECKPOINTS}/BeginCheckpoint": Audited(_answered("checkpoint", lambda r: r.checkpoint.id),
                                               detail=lambda r: {"job": r.job_id, "step": r.step}),
    **{f"/{CHECKPOINTS}/{name}": Audited(_CHECKPOINT) for name in (
        "CommitCheckpoint", "AbortCheckpoint", "DeleteCheckpoint", "ReportDamaged", "RenewRestoreLease",
        "ReleaseRestoreLease", "AcquireRestoreLease")},
    f"/{CHECKPOINTS}/TagCheckpoint": Audited(_CHECKPOINT, detail=lambda r: {"tag": r.tag}),
    f"/{CHECKPOINTS}/UntagCheckpoint": Audited(_CHECKPOINT, detail=lambda r: {"tag": r.tag}),
    f"/{CHECKPOINTS}/SetRetention": Audited(_on("job", lambda r: r.job_id)),
    f"/{CHECKPOINTS}/RunGc": Audited(lambda _req, _resp: "", detail=lambda r: {"dry_run": r.dry_run}),
    f"/{TOKENS}/CreateToken": Audited(_answered("token", lambda r: r.token.token_id), team=lambda r: r.team,
                                      detail=lambda r: {"user": r.user}),
    f"/{TOKENS}/RevokeToken": Audited(_on("token", lambda r: r.token_id)),
}
# Calls that carry several calls of an audited method: each item is audited as a call of that method (its own
# entry, request id and result), not the batch.
BATCHES: Mapping[str, str] = {f"/{JOBS}/SubmitJobs": f"/{JOBS}/SubmitJob"}
LIVENESS = frozenset({f"/{NODES}/Heartbeat", f"/{NODES}/Beat"})
READ_PREFIXES = ("Get", "List", "Watch", "Stream", "Check", "ServerReflection")

# The caller of the RPC being served (None on a plaintext server), for servicers that bind it further.
current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("principal", default=None)


def check(principal: Principal | None, method: str, table: Mapping[str, Rule] = RULES) -> Rule:
    """The rule that admits `principal` to `method`; raises Unauthenticated or PermissionDenied."""
    if principal is None:
        raise Unauthenticated(f"{method} needs a client certificate naming a trainyard:// principal, signed "
                              "by this deployment's CA")
    r = table.get(method)
    if r is None:
        raise PermissionDenied(f"{principal} may not call {method}: it is in no rule of the authorization table")
    if principal.kind not in r.allow:
        raise PermissionDenied(f"{principal} may not call {method} (allowed: "
                               f"{', '.join(sorted(r.allow))})")
    return r


def check_node(principal: Principal, method: str, r: Rule, request: Any) -> None:
    if r.as_node is None or principal.kind != "node":
        return
    claimed = r.as_node(request)
    if claimed != principal.name:
        raise PermissionDenied(f"{principal} may not call {method} for node {claimed!r}: a node speaks only "
                               "for itself")


Behavior = Callable[..., Any]


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks every call against `table` before the servicer sees it. Install it inside the error-mapping
    interceptor (which turns its refusals into status codes)."""

    def __init__(self, table: Mapping[str, Rule] = RULES, jobs: JobBinding | None = None) -> None:
        self._table = table
        self._jobs = jobs

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        table = self._table
        jobs = self._jobs

        def admit(context: grpc.aio.ServicerContext) -> tuple[PeerIdentity, Rule]:
            caller = peer_identity(context)
            r = check(None if caller is None else caller.principal, method, table)
            assert caller is not None
            current_principal.set(caller.principal)
            return caller, r

        async def check_message(caller: PeerIdentity, r: Rule, request: Any,
                                context: grpc.aio.ServicerContext) -> None:
            check_node(caller.principal, method, r, request)
            if r.as_job is None:
                return
            if jobs is None:
                if caller.principal.kind == "job":
                    raise PermissionDenied(f"{caller.principal} may not call {method}: this server does not bind "
                                           "job credentials")
                return
            metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            await jobs.bind(caller, method, r.as_job(request), metadata)

        def checked_requests(requests: AsyncIterator[Any], caller: PeerIdentity, r: Rule,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async def gen() -> AsyncIterator[Any]:
                async for req in requests:
                    await check_message(caller, r, req, context)
                    yield req
            return gen()

        def unary_in(behavior: Behavior) -> Behavior:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                caller, r = admit(context)
                await check_message(caller, r, request, context)
                return await behavior(request, context)
            return call

        def unary_in_stream_out(behavior: Behavior) -> Behavior:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                caller, r = admit(context)
                await check_message(caller, r, request, context)
                async for item in behavior(request, context):
                    yield item
            return call

        def stream_in(behavior: Behavior) -> Behavior:
            async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                caller, r = admit(context)
                return await behavior(checked_requests(requests, caller, r, context), context)
            return call

        def stream_in_stream_out(behavior: Behavior) -> Behavior:
            async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                caller, r = admit(context)
                async for item in behavior(checked_requests(requests, caller, r, context), context):
                    yield item
            return call

        ser, de = handler.response_serializer, handler.request_deserializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary_in(handler.unary_unary), de, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(unary_in_stream_out(handler.unary_stream), de, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(stream_in(handler.stream_unary), de, ser)
        return grpc.stream_stream_rpc_method_handler(stream_in_stream_out(handler.stream_stream), de, ser)
