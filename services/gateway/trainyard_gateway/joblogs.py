"""A job's logs from every node it ran on, merged into one text ordered by rank.

The job's placement (from the scheduler) names the nodes and their ranks; the node list gives each
node's agent address; every agent is asked in parallel for its workers' lines. A node that cannot be
reached does not fail the whole answer: its ranks are named in a trailing `[gateway]` note, and only
when no node answers at all is the request failed (Unavailable → 503). An agent that has no workers of
the job yet (NOT_FOUND: placed but not launched) contributes no lines. Why a node did not answer names its
agent's address (gRPC's own messages do), so only callers who may see addresses (operators) get the
reason; everyone else gets the kind of failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from trainyard_core.errors import NotFound, TrainyardError, Unavailable

from .clients import AgentClients, SchedulerClient
from .schemas.jobs import NodeAssignment
from .schemas.logs import LogLine


@dataclass(frozen=True, slots=True)
class NodeLogs:
    assignment: NodeAssignment
    lines: list[LogLine]
    error: str = ""


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks) or "?"


def render(results: Iterable[NodeLogs], *, max_lines: int) -> str:
    """Lines as `[rank N] text`, ordered by attempt then rank (each rank's lines in their own order),
    then one note per node that did not answer. Pure."""
    results = list(results)
    lines = sorted((line for r in results for line in r.lines), key=lambda ln: (ln.attempt, ln.rank))
    out = [f"[rank {ln.rank}] {ln.text.removesuffix(chr(10))}" for ln in lines]
    if len(out) > max_lines:
        dropped = len(out) - max_lines
        out = out[dropped:]
        out.insert(0, f"[gateway] {dropped} earlier lines left out (at most {max_lines} lines per answer); "
                      "use ?tail=N to choose how many lines per rank")
    for r in results:
        if r.error:
            out.append(f"[gateway] no logs for ranks {_ranks(r.assignment.ranks)} on node "
                       f"{r.assignment.node_id}: {r.error}")
    return "".join(line + "\n" for line in out)


def _failure(exc: TrainyardError, node_id: str, show_addresses: bool) -> str:
    if show_addresses:
        return exc.message
    if isinstance(exc, Unavailable):
        return f"the node agent of {node_id} is unavailable"
    return f"the node agent of {node_id} failed ({type(exc).__name__})"


async def job_logs(scheduler: SchedulerClient, agents: AgentClients, *, job_id: str, team: str,
                   tail_lines: int, attempt: int | None, max_lines: int, show_addresses: bool) -> str:
    """The merged logs of `job_id` (of `attempt`, default the current one; 0: every attempt)."""
    job = await scheduler.get_job(job_id, team=team)
    if not job.placement:
        return ""
    addresses = {n.node_id: n.agent_address for n in await scheduler.list_nodes()}
    wanted = job.attempt if attempt is None else attempt

    async def fetch(assignment: NodeAssignment) -> NodeLogs:
        address = addresses.get(assignment.node_id)
        if not address:
            return NodeLogs(assignment, [], "the node is not registered with the scheduler any more")
        try:
            lines = await agents.worker_logs(address, node_id=assignment.node_id, job_id=job_id,
                                             attempt=wanted, tail_lines=tail_lines)
        except NotFound:
            return NodeLogs(assignment, [])  # placed, but the agent has not started these workers yet
        except TrainyardError as exc:
            return NodeLogs(assignment, [], _failure(exc, assignment.node_id, show_addresses))
        return NodeLogs(assignment, lines)

    results = await asyncio.gather(*(fetch(a) for a in job.placement))
    if all(r.error for r in results):
        raise Unavailable(f"no node agent of job {job_id} answered: "
                          + "; ".join(f"{r.assignment.node_id}: {r.error}" for r in results))
    return render(results, max_lines=max_lines)
