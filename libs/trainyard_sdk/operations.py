"""Every route of the gateway's HTTP API as a pure function: arguments in, a `Call` (or a `Paging`) out.

These are the SDK's methods, written once: `Client` and `AsyncClient` expose each of them (binding.py) by the
same name and arguments, returning the result for the sync client and an awaitable of it for the async one.
Results are the gateway's own response models (`trainyard_gateway.schemas`); request bodies are its request
models, or dicts validated into them before sending (request_parts.body).

A listing comes twice: `list_jobs(...)` iterates over every job across pages (the API's page tokens, followed
until the last page), `list_jobs_page(...)` answers one page (`JobList`, with its `next_page_token`), for a
caller that pages itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainyard_core import contract as c
from trainyard_gateway.schemas.audit import AuditEntry, AuditPage
from trainyard_gateway.schemas.checkpoints import CheckpointList, CheckpointManifest, JobCheckpoint
from trainyard_gateway.schemas.health import Health
from trainyard_gateway.schemas.job_operations import HoldRequest, JobUpdate, RequeueRequest, ResubmitRequest
from trainyard_gateway.schemas.jobs import CancelRequest, Job, JobList, JobSubmit
from trainyard_gateway.schemas.nodes import CordonRequest, GpuHealthRequest, Node, NodeList
from trainyard_gateway.schemas.pending import PendingList
from trainyard_gateway.schemas.queues import Queue, QueueList, QueuePut
from trainyard_gateway.schemas.quotas import Quota, QuotaList, QuotaPut
from trainyard_gateway.schemas.streams import JobEvents
from trainyard_gateway.schemas.tokens import Token, TokenCreate, TokenCreated, TokenList
from trainyard_gateway.schemas.usage import UsageReport

from .request_parts import Time, body, labels, optional_body, query, segment
from .wire import IDEMPOTENCY_HEADER, Call, Paging, Request, field_of, model, text

Body = Mapping[str, Any]


def _jobs(job_id: str, rest: str = "") -> str:
    return f"/v1/jobs/{segment('job_id', job_id)}{rest}"


def _idempotency(key: str | None) -> tuple[tuple[str, str], ...]:
    return ((IDEMPOTENCY_HEADER, key),) if key else ()


def _reason(cls: type[CancelRequest], reason: str) -> Any:
    return body(cls, {"reason": reason}) if reason else None


# --- health -----------------------------------------------------------------------------------------------

def health() -> Call[Health]:
    """GET /healthz: whether the gateway reaches the scheduler and etcd (`status` ok or degraded; no token)."""
    return Call(Request("GET", "/healthz"), model(Health), accept=frozenset({503}))


# --- jobs -------------------------------------------------------------------------------------------------

def submit_job(spec: JobSubmit | Body, *, idempotency_key: str | None = None) -> Call[Job]:
    """POST /v1/jobs. With `idempotency_key`, a retry of the same spec answers the job the first one created
    (and the SDK retries the submit itself after a 429 or 503)."""
    return Call(Request("POST", "/v1/jobs", body=body(JobSubmit, spec), headers=_idempotency(idempotency_key)),
                model(Job))


def get_job(job_id: str) -> Call[Job]:
    """GET /v1/jobs/{job_id}."""
    return Call(Request("GET", _jobs(job_id)), model(Job))


def list_jobs_page(*, page_size: int = c.DEFAULT_PAGE_SIZE, page_token: str = "",
                   state: str | Sequence[str] | None = None, team: str = "", user: str = "", queue: str = "",
                   label: Mapping[str, str] | Sequence[str] | None = None, name_prefix: str = "",
                   submitted_after: Time | None = None, submitted_before: Time | None = None,
                   finished_after: Time | None = None, finished_before: Time | None = None) -> Call[JobList]:
    """GET /v1/jobs: one page, newest first. `label`: {key: value} or ["key=value", ...]; every filter given
    must match."""
    params = query(page_size=page_size, page_token=page_token, state=state, team=team, user=user, queue=queue,
                   label=labels(label), name_prefix=name_prefix, submitted_after=submitted_after,
                   submitted_before=submitted_before, finished_after=finished_after, finished_before=finished_before)
    return Call(Request("GET", "/v1/jobs", params=tuple(params)), model(JobList))


def list_jobs(*, page_size: int = c.DEFAULT_PAGE_SIZE, state: str | Sequence[str] | None = None, team: str = "",
              user: str = "", queue: str = "", label: Mapping[str, str] | Sequence[str] | None = None,
              name_prefix: str = "", submitted_after: Time | None = None, submitted_before: Time | None = None,
              finished_after: Time | None = None, finished_before: Time | None = None) -> Paging[Job]:
    """Every job matching the filters, newest first, across pages (`list_jobs_page`'s filters)."""

    def page(token: str) -> Call[JobList]:
        return list_jobs_page(page_size=page_size, page_token=token, state=state, team=team, user=user,
                              queue=queue, label=label, name_prefix=name_prefix, submitted_after=submitted_after,
                              submitted_before=submitted_before, finished_after=finished_after,
                              finished_before=finished_before)

    page(token="")  # the arguments are checked now, not at the first iteration
    return Paging(page, lambda p: p.jobs, lambda p: p.next_page_token)


def cancel_job(job_id: str, *, reason: str = "") -> Call[Job]:
    """POST /v1/jobs/{job_id}:cancel (idempotent)."""
    return Call(Request("POST", _jobs(job_id, ":cancel"), body=_reason(CancelRequest, reason)), model(Job))


def hold_job(job_id: str, *, reason: str = "") -> Call[Job]:
    """POST /v1/jobs/{job_id}:hold: a pending job stays in its place in the queue but is not placed."""
    return Call(Request("POST", _jobs(job_id, ":hold"), body=_reason(HoldRequest, reason)), model(Job))


def release_job(job_id: str) -> Call[Job]:
    """POST /v1/jobs/{job_id}:release."""
    return Call(Request("POST", _jobs(job_id, ":release")), model(Job))


def requeue_job(job_id: str, *, reason: str = "") -> Call[Job]:
    """POST /v1/jobs/{job_id}:requeue: stop a running job as in a preemption and queue it as a new attempt."""
    return Call(Request("POST", _jobs(job_id, ":requeue"), body=_reason(RequeueRequest, reason)), model(Job))


def set_job_priority(job_id: str, priority: int) -> Call[Job]:
    """PATCH /v1/jobs/{job_id} with the new priority of a job that has not finished."""
    return Call(Request("PATCH", _jobs(job_id), body=body(JobUpdate, {"priority": priority})), model(Job))


def resubmit_job(job_id: str, overrides: Body | None = None, *, idempotency_key: str | None = None) -> Call[Job]:
    """POST /v1/jobs/{job_id}:resubmit: a new job from this one's spec with `overrides` merged in (a JSON merge
    patch of the submit body: None removes a key)."""
    request = body(ResubmitRequest, {"overrides": dict(overrides or {})})
    return Call(Request("POST", _jobs(job_id, ":resubmit"), body=request, headers=_idempotency(idempotency_key)),
                model(Job))


def job_logs(job_id: str, *, tail: int = 0, attempt: int | None = None, rank: int | Sequence[int] | None = None,
             since: Time | None = None) -> Call[str]:
    """GET /v1/jobs/{job_id}/logs: every rank's lines so far, as text (`[rank N] ...`; `follow_logs` streams
    them). `tail`: the last N lines of each rank (0: all); `attempt`: that attempt (0: every attempt; default the
    current one); `rank`: only these ranks; `since`: leave out the attempts that ended before it."""
    params = query(tail=tail, attempt=attempt, rank=rank, since=since)
    return Call(Request("GET", _jobs(job_id, "/logs"), params=tuple(params)), text)


def job_events(job_id: str) -> Call[JobEvents]:
    """GET /v1/jobs/{job_id}/events: what happened to the job, oldest first (`watch_job` follows it)."""
    return Call(Request("GET", _jobs(job_id, "/events")), model(JobEvents))


# --- checkpoints ------------------------------------------------------------------------------------------

def _checkpoint(job_id: str, checkpoint_id: str, rest: str = "") -> str:
    return _jobs(job_id, f"/checkpoints/{segment('checkpoint_id', checkpoint_id)}{rest}")


def list_checkpoints_page(job_id: str, *, page_size: int = c.DEFAULT_PAGE_SIZE,
                          page_token: str = "") -> Call[CheckpointList]:
    """GET /v1/jobs/{job_id}/checkpoints: one page, oldest first."""
    params = query(page_size=page_size, page_token=page_token)
    return Call(Request("GET", _jobs(job_id, "/checkpoints"), params=tuple(params)), model(CheckpointList))


def list_checkpoints(job_id: str, *, page_size: int = c.DEFAULT_PAGE_SIZE) -> Paging[JobCheckpoint]:
    """Every checkpoint of the job, oldest first, across pages."""

    def page(token: str) -> Call[CheckpointList]:
        return list_checkpoints_page(job_id, page_size=page_size, page_token=token)

    page("")
    return Paging(page, lambda p: p.checkpoints, lambda p: p.next_page_token)


def get_checkpoint(job_id: str, checkpoint_id: str) -> Call[JobCheckpoint]:
    """GET /v1/jobs/{job_id}/checkpoints/{checkpoint_id}, with `lineage.job_spec`."""
    return Call(Request("GET", _checkpoint(job_id, checkpoint_id)), model(JobCheckpoint))


def checkpoint_manifest(job_id: str, checkpoint_id: str) -> Call[CheckpointManifest]:
    """GET .../{checkpoint_id}/manifest: the files of a committed checkpoint."""
    return Call(Request("GET", _checkpoint(job_id, checkpoint_id, "/manifest")), model(CheckpointManifest))


def tag_checkpoint(job_id: str, checkpoint_id: str, tag: str) -> Call[JobCheckpoint]:
    """PUT .../{checkpoint_id}/tags/{tag} (idempotent): keeps it from retention and garbage collection."""
    path = _checkpoint(job_id, checkpoint_id, f"/tags/{segment('tag', tag)}")
    return Call(Request("PUT", path), model(JobCheckpoint))


def untag_checkpoint(job_id: str, checkpoint_id: str, tag: str) -> Call[JobCheckpoint]:
    """DELETE .../{checkpoint_id}/tags/{tag} (idempotent)."""
    path = _checkpoint(job_id, checkpoint_id, f"/tags/{segment('tag', tag)}")
    return Call(Request("DELETE", path), model(JobCheckpoint))


def delete_checkpoint(job_id: str, checkpoint_id: str) -> Call[JobCheckpoint]:
    """DELETE .../{checkpoint_id} (idempotent; not the latest, nor a tagged one)."""
    return Call(Request("DELETE", _checkpoint(job_id, checkpoint_id)), model(JobCheckpoint))


# --- nodes ------------------------------------------------------------------------------------------------

def _node(node_id: str, rest: str = "") -> str:
    return f"/v1/nodes/{segment('node_id', node_id)}{rest}"


def list_nodes() -> Call[list[Node]]:
    """GET /v1/nodes (hostnames and agent addresses for operators only)."""
    return Call(Request("GET", "/v1/nodes"), field_of(NodeList, lambda r: r.nodes))


def get_node(node_id: str) -> Call[Node]:
    """GET /v1/nodes/{node_id}."""
    return Call(Request("GET", _node(node_id)), model(Node))


def cordon_node(node_id: str, *, reason: str = "") -> Call[Node]:
    """POST /v1/nodes/{node_id}:cordon (operators): no new placement on the node."""
    return Call(Request("POST", _node(node_id, ":cordon"), body=optional_body(
        CordonRequest, {"reason": reason} if reason else None)), model(Node))


def uncordon_node(node_id: str) -> Call[Node]:
    """POST /v1/nodes/{node_id}:uncordon (operators)."""
    return Call(Request("POST", _node(node_id, ":uncordon")), model(Node))


def set_gpu_health(node_id: str, gpu_index: int, *, healthy: bool, reason: str) -> Call[Node]:
    """POST /v1/nodes/{node_id}/gpus/{gpu_index}:set-health (operators): back in service after repair, or out."""
    if isinstance(gpu_index, bool) or not isinstance(gpu_index, int):
        raise TypeError(f"gpu_index must be an int, not {type(gpu_index).__name__}")
    request = body(GpuHealthRequest, {"healthy": healthy, "reason": reason})
    return Call(Request("POST", _node(node_id, f"/gpus/{gpu_index}:set-health"), body=request), model(Node))


# --- queues and quotas ------------------------------------------------------------------------------------

def list_queues() -> Call[list[Queue]]:
    """GET /v1/queues."""
    return Call(Request("GET", "/v1/queues"), field_of(QueueList, lambda r: r.queues))


def put_queue(name: str, queue: QueuePut | Body) -> Call[Queue]:
    """PUT /v1/queues/{name} (operators): create or replace the whole queue."""
    return Call(Request("PUT", f"/v1/queues/{segment('name', name)}", body=body(QueuePut, queue)), model(Queue))


def delete_queue(name: str) -> Call[Queue]:
    """DELETE /v1/queues/{name} (operators)."""
    return Call(Request("DELETE", f"/v1/queues/{segment('name', name)}"), model(Queue))


def list_quotas() -> Call[list[Quota]]:
    """GET /v1/quotas (operators: every team's; others: their own)."""
    return Call(Request("GET", "/v1/quotas"), field_of(QuotaList, lambda r: r.quotas))


def get_quota(team: str) -> Call[Quota]:
    """GET /v1/quotas/{team}, with what the team holds now (`use`)."""
    return Call(Request("GET", f"/v1/quotas/{segment('team', team)}"), model(Quota))


def put_quota(team: str, quota: QuotaPut | Body) -> Call[Quota]:
    """PUT /v1/quotas/{team} (operators): create or replace the whole quota."""
    return Call(Request("PUT", f"/v1/quotas/{segment('team', team)}", body=body(QuotaPut, quota)), model(Quota))


def delete_quota(team: str) -> Call[Quota]:
    """DELETE /v1/quotas/{team} (operators)."""
    return Call(Request("DELETE", f"/v1/quotas/{segment('team', team)}"), model(Quota))


# --- tokens -----------------------------------------------------------------------------------------------

def create_token(team: str, user: str, *, role: str = c.DEFAULT_ROLE.value, ttl: str | None = None,
                 scopes: Sequence[str] = (), description: str = "") -> Call[TokenCreated]:
    """POST /v1/tokens (team admins, operators): the answer holds the secret, once."""
    fields: dict[str, Any] = {"team": team, "user": user, "role": role, "scopes": list(scopes),
                              "description": description}
    if ttl is not None:
        fields["ttl"] = ttl
    return Call(Request("POST", "/v1/tokens", body=body(TokenCreate, fields)), model(TokenCreated))


def list_tokens(*, team: str = "") -> Call[list[Token]]:
    """GET /v1/tokens (team admins: their team's; operators: every team's, or `team`'s)."""
    return Call(Request("GET", "/v1/tokens", params=tuple(query(team=team))),
                field_of(TokenList, lambda r: r.tokens))


def revoke_token(token_id: str) -> Call[Token]:
    """DELETE /v1/tokens/{token_id}."""
    return Call(Request("DELETE", f"/v1/tokens/{segment('token_id', token_id)}"), model(Token))


# --- the queue --------------------------------------------------------------------------------------------

def list_pending(*, queue: str = "", job_id: str = "", team: str = "", limit: int | None = None) -> Call[PendingList]:
    """GET /v1/pending: pending jobs in queue order as the scheduler's last cycle considered them, each with its
    place in its queue and why it waits (held jobs last, place 0)."""
    params = query(queue=queue, job_id=job_id, team=team, limit=limit)
    return Call(Request("GET", "/v1/pending", params=tuple(params)), model(PendingList))


# --- audit and usage --------------------------------------------------------------------------------------

def audit_page(*, page_size: int = c.DEFAULT_PAGE_SIZE, page_token: str = "", principal: str = "", user: str = "",
               team: str = "", action: str = "", target: str = "", result: str = "", request_id: str = "",
               since: Time | None = None, until: Time | None = None) -> Call[AuditPage]:
    """GET /v1/audit (operators): one page, newest first. A page may hold fewer entries than page_size (even
    none) while more follow."""
    params = query(page_size=page_size, page_token=page_token, principal=principal, user=user, team=team,
                   action=action, target=target, result=result, request_id=request_id, since=since, until=until)
    return Call(Request("GET", "/v1/audit", params=tuple(params)), model(AuditPage))


def audit(*, page_size: int = c.DEFAULT_PAGE_SIZE, principal: str = "", user: str = "", team: str = "",
          action: str = "", target: str = "", result: str = "", request_id: str = "", since: Time | None = None,
          until: Time | None = None) -> Paging[AuditEntry]:
    """Every audit entry matching the filters, newest first, across pages (`audit_page`'s filters)."""

    def page(token: str) -> Call[AuditPage]:
        return audit_page(page_size=page_size, page_token=token, principal=principal, user=user, team=team,
                          action=action, target=target, result=result, request_id=request_id, since=since,
                          until=until)

    page("")
    return Paging(page, lambda p: p.entries, lambda p: p.next_page_token)


def usage(*, from_: Time | None = None, to: Time | None = None, group_by: str = c.DEFAULT_USAGE_GROUP,
          team: str = "", limit: int | None = None) -> Call[UsageReport]:
    """GET /v1/usage: GPU-hours, CPU-hours and cost in [from_, to) (default: the last 30 days), grouped by team,
    project, user, model, queue or job."""
    params = query(from_=from_, to=to, group_by=group_by, team=team, limit=limit)
    return Call(Request("GET", "/v1/usage", params=tuple(params)), model(UsageReport))
