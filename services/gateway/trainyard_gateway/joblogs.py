"""A job's logs from every node it ran on, merged into one text ordered by attempt and rank; and which node
holds which ranks of which attempt (`attempt_shares`), which the follow stream (`logstream`) uses too.

Where an attempt ran: the job's current attempt from its placement (exact ranks); every ended attempt from
the job's attempt records (`Job.attempts`: the scheduler keeps the latest 200), whose nodes are listed in
node-rank order, so their ranks follow as placement assigns them (node i holds ranks
i*g .. i*g+g-1 with g = gpus_per_node, one rank per node for a CPU task). So the logs of attempt 1 on node A
are asked of node A's agent after the job restarted on node B, for as long as that agent keeps them.

Every agent is asked in parallel. A node that cannot be reached does not fail the whole answer: its ranks
are named in a trailing `[gateway]` note, and only when no node answers at all is the request failed
(Unavailable → 503). An agent that has no workers of the job (NOT_FOUND: placed but not launched, or a
replaced state directory) contributes no lines. Why a node did not answer names its agent's address (gRPC's
own messages do), so only callers who may see addresses (operators) get the reason; everyone else gets the
kind of failure.

The answer holds at most `max_lines` lines, shared fairly (`fair_shares`): when the lines of all ranks do
not fit, every rank keeps its newest lines, as many as an equal share allows (a rank with fewer keeps all
of them and its unused share goes to the others), and a leading `[gateway]` note says how many lines of
which ranks were left out.

`since` selects lines: the agents keep the time each line was written and answer only those at or after it
(compared to the millisecond: `unix_ms`); `tail` is then the last lines of those. Lines of unknown time
(files written by an agent from before per-line times) are kept: `since` cannot place them. An attempt that
ended before `since` is not asked at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from trainyard_core.errors import NotFound, TrainyardError, Unavailable

from .clients import AgentClients, SchedulerClient
from .clients_streams import logs_request, read_worker_logs
from .schemas.jobs import Job, NodeAssignment
from .schemas.logs import LogLine


@dataclass(frozen=True, slots=True)
class NodeLogs:
    assignment: NodeAssignment
    lines: list[LogLine]
    error: str = ""


# --- where each attempt ran (pure) ------------------------------------------------------------------------

def attempt_shares(job: Job) -> dict[int, list[NodeAssignment]]:
    """attempt → the nodes it ran on (or runs on), each with its ranks, in node-rank order."""
    per_node = max(1, job.spec.resources.gpus_per_node)
    out: dict[int, list[NodeAssignment]] = {}
    for record in job.attempts:
        out[record.attempt] = [
            NodeAssignment(node_id=node, node_rank=i, gpu_indices=[], model="", cpus=0,
                           ranks=list(range(i * per_node, (i + 1) * per_node)))
            for i, node in enumerate(record.nodes)]
    if job.placement and job.attempt:
        out[job.attempt] = sorted(job.placement, key=lambda a: a.node_rank)
    return out


def unix_ms(at: datetime | None) -> int:
    """`at` in unix milliseconds, rounded down: lines are compared to the millisecond, so a line written in
    the same millisecond as `at` counts as at or after it; 0 for None (no bound). Pure."""
    if at is None:
        return 0
    return max(1, round(at.timestamp() * 1_000_000) // 1000)


def attempt_ended_before(job: Job, attempt: int, since: datetime | None) -> bool:
    """Whether `attempt` ended before `since` (so `since` leaves it out)."""
    if since is None:
        return False
    for record in job.attempts:
        if record.attempt == attempt and record.ended_at is not None:
            return record.ended_at < since
    return False


def selected_attempts(job: Job, shares: Mapping[int, object], *, attempt: int | None,
                      since: datetime | None) -> list[int]:
    """The attempts a plain (non-follow) read shows: the current one by default, `attempt` when given, every
    one for 0; less those that ended before `since`."""
    if attempt is None:
        wanted = [job.attempt] if job.attempt else []
    elif attempt == 0:
        wanted = sorted(shares)
    else:
        wanted = [attempt]
    return [a for a in wanted if not attempt_ended_before(job, a, since)]


def wanted_share(share: NodeAssignment, ranks: Collection[int]) -> bool:
    """A node is asked only when it holds a rank asked for (no `rank` filter: every node)."""
    return not ranks or any(r in ranks for r in share.ranks)


# --- the fair cap (pure) ----------------------------------------------------------------------------------

def fair_shares(counts: Mapping[int, int], cap: int) -> dict[int, int]:
    """How many of its lines each rank keeps when at most `cap` lines are shown in all.

    Water-filling: the largest level such that every rank keeping min(its lines, level) fits, so a rank with
    few lines keeps all of them and its unused share goes to the others; the few lines an uneven division
    leaves go one each to the lowest ranks that still have more. Pure."""
    remaining, left = max(0, cap), len(counts)
    for count in sorted(counts.values()):
        if count * left > remaining:
            level = remaining // left  # every rank with more lines than this is cut to it
            break
        remaining, left = remaining - count, left - 1
    else:
        return dict(counts)  # everything fits
    keep = {rank: min(count, level) for rank, count in counts.items()}
    spare = max(0, cap) - sum(keep.values())
    for rank in sorted(counts):
        if spare <= 0:
            break
        if keep[rank] < counts[rank]:
            keep[rank] += 1
            spare -= 1
    return keep


def rank_ranges(ranks: Iterable[int]) -> str:
    """`0-3,7,9-10`: a set of ranks, short. Pure."""
    out: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in ranks) or "?"


def _left_out_note(dropped: Mapping[int, int], max_lines: int, ranks: int) -> str:
    by_count: dict[int, list[int]] = {}
    for rank, n in dropped.items():
        if n:
            by_count.setdefault(n, []).append(rank)
    parts = []
    for n, group in sorted(by_count.items(), key=lambda kv: min(kv[1])):
        which = f"rank {group[0]}" if len(group) == 1 else f"ranks {rank_ranges(group)}"
        parts.append(f"{which}: {n}" + (" each" if len(group) > 1 else ""))
    total = sum(dropped.values())
    return (f"[gateway] {total} earlier lines left out (at most {max_lines} lines per answer, shared by the "
            f"{ranks} ranks, each keeping its newest; {', '.join(parts)}); use ?tail=N for the last N lines "
            "of each rank, or ?rank=R")


def render(results: Iterable[NodeLogs], *, max_lines: int) -> str:
    """Lines as `[rank N] text`, ordered by attempt then rank (each rank's lines in their own order), capped
    fairly (`fair_shares`), then one note per node that did not answer. Pure."""
    results = list(results)
    by_rank: dict[int, list[LogLine]] = {}
    for line in sorted((ln for r in results for ln in r.lines), key=lambda ln: ln.attempt):
        by_rank.setdefault(line.rank, []).append(line)
    counts = {rank: len(lines) for rank, lines in by_rank.items()}
    notes: list[str] = []
    if sum(counts.values()) > max_lines:
        keep = fair_shares(counts, max_lines)
        by_rank = {rank: lines[len(lines) - keep[rank]:] for rank, lines in by_rank.items()}
        notes.append(_left_out_note({r: counts[r] - keep[r] for r in counts}, max_lines, len(counts)))
    lines = sorted((ln for kept in by_rank.values() for ln in kept), key=lambda ln: (ln.attempt, ln.rank))
    out = notes + [f"[rank {ln.rank}] {ln.text.removesuffix(chr(10))}" for ln in lines]
    for r in results:
        if r.error:
            out.append(f"[gateway] no logs for ranks {_ranks(r.assignment.ranks)} on node "
                       f"{r.assignment.node_id}: {r.error}")
    return "".join(line + "\n" for line in out)


def failure(exc: TrainyardError, node_id: str, show_addresses: bool) -> str:
    if show_addresses:
        return exc.message
    if isinstance(exc, Unavailable):
        return f"the node agent of {node_id} is unavailable"
    return f"the node agent of {node_id} failed ({type(exc).__name__})"


# --- the plain read ---------------------------------------------------------------------------------------

async def job_logs(scheduler: SchedulerClient, agents: AgentClients, *, job_id: str, team: str,
                   tail_lines: int, attempt: int | None, max_lines: int, show_addresses: bool, timeout_s: float,
                   ranks: Collection[int] = (), since: datetime | None = None) -> str:
    """The merged logs of `job_id` (of `attempt`, default the current one; 0: every attempt), of `ranks`
    (default all), of the attempts not ended before `since`."""
    return await logs_of(scheduler, agents, await scheduler.get_job(job_id, team=team), tail_lines=tail_lines,
                         attempt=attempt, max_lines=max_lines, show_addresses=show_addresses, ranks=ranks,
                         since=since, timeout_s=timeout_s)


async def logs_of(scheduler: SchedulerClient, agents: AgentClients, job: Job, *, tail_lines: int,
                  attempt: int | None, max_lines: int, show_addresses: bool, timeout_s: float,
                  ranks: Collection[int] = (), since: datetime | None = None) -> str:
    shares = attempt_shares(job)
    attempts = selected_attempts(job, shares, attempt=attempt, since=since)
    # One call per node: for one attempt that attempt, for several every attempt (0), filtered here.
    asked: dict[str, NodeAssignment] = {}
    for a in attempts:
        for share in shares.get(a, []):
            if not wanted_share(share, ranks):
                continue
            known = asked.get(share.node_id)
            asked[share.node_id] = share if known is None else known.model_copy(
                update={"ranks": sorted({*known.ranks, *share.ranks})})
    if not asked:
        return ""
    addresses = {n.node_id: n.agent_address for n in await scheduler.list_nodes()}
    ask_attempt = attempts[0] if len(attempts) == 1 else 0

    async def fetch(share: NodeAssignment) -> NodeLogs:
        address = addresses.get(share.node_id)
        if not address:
            return NodeLogs(share, [], "the node is not registered with the scheduler any more")
        try:
            request = logs_request(job_id=job.id, attempt=ask_attempt, tail_lines=tail_lines, since_ms=unix_ms(since))
            lines = await read_worker_logs(agents, address, node_id=share.node_id, timeout_s=timeout_s,
                                           request=request)
        except NotFound:
            return NodeLogs(share, [])  # placed, but the agent has not started these workers yet
        except TrainyardError as exc:
            return NodeLogs(share, [], failure(exc, share.node_id, show_addresses))
        keep = set(attempts)
        return NodeLogs(share, [ln for ln in lines if ln.attempt in keep and (not ranks or ln.rank in ranks)])

    results = await asyncio.gather(*(fetch(s) for s in asked.values()))
    if all(r.error for r in results):
        raise Unavailable(f"no node agent of job {job.id} answered: "
                          + "; ".join(f"{r.assignment.node_id}: {r.error}" for r in results))
    return render(results, max_lines=max_lines)
