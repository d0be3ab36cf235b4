"""Following a job's logs (`GET /v1/jobs/{id}/logs?follow=true`): the agents' StreamWorkerLogs of every node
of every attempt asked for, merged into one server-sent event stream that a client can resume exactly.

Sources. One source per (node, attempt), from `joblogs.attempt_shares`: ended attempts from the job's
attempt records, the current one from its placement. The job itself is watched (the scheduler's WatchJob),
so a restart's new attempt adds its sources while the stream runs. Which attempts: by default the current
one and every later one (a follow goes on across restarts; a resumed one from the earliest attempt its id
has lines of, so a restart while the client was away loses nothing); `attempt=N` that one only; `attempt=0`
every one. `since` is passed to the agents, which send only the lines written at or after it (and those of
unknown time: files written before the agents kept a time per line); attempts that ended before it are not
read at all. `rank` leaves out every other rank (and the nodes that hold none of them).

A source opens its agent's stream, which sends the retained lines of that attempt on that node that it asks
for (`_request`: after the seqs already sent, or the tail, and not before `since`) and then the new ones until
no worker of it runs there. It ends for good when its workers have ended (ListWorkers
knows them and none runs), and is opened again otherwise: before its workers started (NOT_FOUND, or a
stream that ended with nothing), after the agent restarted, or when it could not be reached (an `event:
warning` names the node and its ranks, once per run of failures; the reason, which names the agent's
address, only for operators). Once the job has ended, a node that fails three times in a row is given up.

Positions and resuming. Every line of a rank in an attempt has a sequence number (`seq`, from 1), which the
agent's log writer keeps across rotation and restarts of the worker's shim. The `id` of each `line` event is
the last seq sent of every (attempt, rank) so far (`encode_positions`: `attempt:first_rank=seq,seq,...;...`
for runs of ranks, a rank's node implied: one rank of one attempt runs on one node). A client that
reconnects with it as `Last-Event-ID` gets each (attempt, rank) from its next line on: every stream opened
again (resumed, or after an agent restart) asks the agent for the lines after those seqs (`after_seq`), so
nothing is sent twice and nothing is skipped while the agent keeps the lines, however many older files
rotation dropped meanwhile. Lines of files written before the agents numbered them are numbered by position,
so for those alone a dropped file still shifts the numbers; an agent from before line numbers (its lines
have seq 0, it ignores `after_seq`) has its lines numbered by position in each stream and those already
sent skipped. The format of ids did not change from when they
counted lines sent: an id from a gateway of that version resumes, exactly unless rotation dropped lines of
that rank, and then by sending again some lines the client has. Past `MAX_ID_LENGTH` (thousands of ranks
followed at once) events go without ids (a `warning` says so: follow fewer ranks).

`tail=N` (first connection only): each source present when the stream starts asks its agent's stream for the
last N lines of each rank (of those `since` selects), then the new ones; a source opened again before any line
came asks again, one opened again after lines came asks after the seqs sent instead. Ranks and attempts that
appear later start from their first line. A rank's start enters the ids as soon as a batch of its lines
arrives (one before its first seq there), so a resume from an event before that rank's first line keeps
where its tail started instead of starting it over.

The end: once the job is terminal (for `attempt=N`: once that attempt is over) and every source has
ended, an `event: end` with the job's state, and the stream closes. Closing the stream (the client went
away) cancels every task of it, and with them the agent and scheduler streams (`clients_streams`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from trainyard_core.contract import JobState
from trainyard_core.errors import NotFound, TrainyardError
from trainyard_core.waits import completes_within

from . import joblogs
from .clients import AgentClients, SchedulerClient
from .clients_streams import logs_request, stream_worker_logs, watch_job, workers_known
from .schemas.jobs import Job
from .schemas.logs import LogLine
from .sse import Event

Key = tuple[int, int]  # (attempt, rank)

_GROUP = r"\d{1,10}:\d{1,10}=\d{1,19}(?:,\d{1,19})*"
POSITIONS_PATTERN = rf"^(?:{_GROUP}(?:;{_GROUP})*)?$"
_POSITIONS = re.compile(POSITIONS_PATTERN)
MAX_ID_LENGTH = 16384
GIVE_UP_AFTER = 3          # failures in a row of one node, once the job has ended
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
OPEN_PER_NODE = 4          # agent streams of one follow open at once on one node
QUEUE_BATCHES = 64         # batches of lines waiting for a slow client before the agents' streams wait


# --- positions (pure) -------------------------------------------------------------------------------------

def encode_positions(positions: Mapping[Key, int]) -> str:
    """`1:0=12,15,3;2:4=9`: attempt 1 ranks 0-2 at seqs 12, 15 and 3, attempt 2 rank 4 at 9. Positions of 0
    are left out (0 is where a rank starts anyway). Pure; `decode_positions` reads it back."""
    by_attempt: dict[int, list[int]] = {}
    for (attempt, rank), count in positions.items():
        if count > 0:
            by_attempt.setdefault(attempt, []).append(rank)
    return ";".join(_encode_attempt(attempt, sorted(ranks), positions)
                    for attempt, ranks in sorted(by_attempt.items()))


def _encode_attempt(attempt: int, ranks: list[int], positions: Mapping[Key, int]) -> str:
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(f"{attempt}:{ranks[i]}=" + ",".join(str(positions[(attempt, r)]) for r in ranks[i:j + 1]))
        i = j + 1
    return ";".join(runs)


def decode_positions(text: str) -> dict[Key, int]:
    """The positions of an id; ValueError for text that is not one. Pure."""
    if not _POSITIONS.match(text):
        raise ValueError("not a log stream event id")
    out: dict[Key, int] = {}
    for group in filter(None, text.split(";")):
        head, _, counts = group.partition("=")
        attempt, _, first = head.partition(":")
        for offset, count in enumerate(counts.split(",")):
            if int(count):
                out[(int(attempt), int(first) + offset)] = int(count)
    return out


class PositionIds:
    """The positions reached, with each attempt's part of the id kept encoded until it changes, so an
    event's id costs the ranks of one attempt, not of every attempt."""

    def __init__(self, start: Mapping[Key, int] | None = None) -> None:
        self._positions: dict[Key, int] = dict(start or {})
        self._encoded: dict[int, str] = {}

    def get(self, key: Key) -> int:
        return self._positions.get(key, 0)

    def set(self, key: Key, value: int) -> None:
        self._positions[key] = value
        self._encoded.pop(key[0], None)

    def text(self) -> str:
        parts = []
        for attempt in sorted({a for a, _ in self._positions}):
            part = self._encoded.get(attempt)
            if part is None:
                ranks = sorted(r for a, r in self._positions if a == attempt and self._positions[(a, r)] > 0)
                part = self._encoded[attempt] = _encode_attempt(attempt, ranks, self._positions)
            if part:
                parts.append(part)
        return ";".join(parts)


def attempt_over(job: Job, attempt: int) -> bool:
    """No worker of `attempt` will write again: the job ended, moved to a later attempt, or recorded its end."""
    return (JobState(job.state).terminal or job.attempt > attempt
            or any(a.attempt == attempt for a in job.attempts))


# --- the stream -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FollowQuery:
    job_id: str
    team: str
    attempt: int | None = None      # None: the current one and later ones; 0: every one
    ranks: frozenset[int] = frozenset()
    since: datetime | None = None
    tail: int = 0
    resume: Mapping[Key, int] | None = None
    show_addresses: bool = False


@dataclass(frozen=True, slots=True)
class _Lines:
    node: str
    lines: list[LogLine]


@dataclass(frozen=True, slots=True)
class _Note:
    event: Event


_WAKE = object()  # something changed: see whether the stream is over


@dataclass
class _Source:
    node: str
    attempt: int
    ranks: list[int]
    tail: bool
    task: asyncio.Task[None] | None = None
    lines: int = 0
    failures: int = 0


class LogFollow:
    """One follow stream; `events()` is its server-sent events. Not shared between requests."""

    def __init__(self, scheduler: SchedulerClient, agents: AgentClients, query: FollowQuery, job: Job, *,
                 timeout_s: float) -> None:
        self.scheduler = scheduler
        self.agents = agents
        self.query = query
        self.job = job
        self.timeout_s = timeout_s
        self._queue: asyncio.Queue[Any] = asyncio.Queue(QUEUE_BATCHES)
        self._sources: dict[tuple[str, int], _Source] = {}
        # Per (attempt, rank): the last seq handed to the queue (or sent before a resume); `_ids`: sent.
        self._queued: dict[Key, int] = dict(query.resume or {})
        self._ids = PositionIds(query.resume)
        self._changed = asyncio.Event()
        self._addresses: dict[str, str] = {}
        self._node_slots: dict[str, asyncio.Semaphore] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._gone = False
        if query.attempt is not None:
            self._floor = query.attempt or 1
        else:  # resuming: from the earliest attempt the client has lines of, or the current one
            self._floor = min([max(1, job.attempt), *(a for a, _ in query.resume or ())])

    # the attempts and nodes to read

    def _wanted(self, attempt: int) -> bool:
        q = self.query
        if q.attempt:
            return attempt == q.attempt
        return attempt >= self._floor and not joblogs.attempt_ended_before(self.job, attempt, q.since)

    def _add_sources(self, *, at_start: bool) -> None:
        tail = at_start and self.query.tail > 0 and not self.query.resume
        for attempt, shares in joblogs.attempt_shares(self.job).items():
            if not self._wanted(attempt):
                continue
            for share in shares:
                if (share.node_id, attempt) in self._sources or not joblogs.wanted_share(share, self.query.ranks):
                    continue
                source = _Source(share.node_id, attempt, list(share.ranks), tail)
                self._sources[(share.node_id, attempt)] = source
                source.task = self._spawn(self._follow_source(source))

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        return task

    def _over(self) -> bool:
        if self._gone:
            return True
        attempt = self.query.attempt
        done = attempt_over(self.job, attempt) if attempt else JobState(self.job.state).terminal
        return done and all(s.task is not None and s.task.done() for s in self._sources.values())

    async def _wait_change(self, timeout_s: float) -> None:
        await completes_within(self._changed.wait(), timeout_s)

    def _set_job(self, job: Job) -> None:
        self.job = job
        self._add_sources(at_start=False)
        self._changed.set()
        self._changed = asyncio.Event()

    # the tasks

    async def _watch(self) -> None:
        delay = RETRY_MIN_S
        while not JobState(self.job.state).terminal:
            try:
                async for job in watch_job(self.scheduler, self.query.job_id, team=self.query.team):
                    self._set_job(job)
                    await self._queue.put(_WAKE)
                    delay = RETRY_MIN_S
                if not JobState(self.job.state).terminal:
                    # The watch ended early (the job left etcd for the history store): read its end.
                    self._set_job(await self.scheduler.get_job(self.query.job_id, team=self.query.team))
                    await self._queue.put(_WAKE)
            except NotFound:
                self._gone = True
                await self._queue.put(_WAKE)
                return
            except TrainyardError:
                await asyncio.sleep(delay)  # the scheduler is unreachable for now; the agents go on streaming
                delay = min(RETRY_MAX_S, delay * 2)

    async def _address(self, node: str, *, refresh: bool) -> str:
        if refresh or node not in self._addresses:
            self._addresses = {n.node_id: n.agent_address or "" for n in await self.scheduler.list_nodes()}
        return self._addresses.get(node, "")

    async def _follow_source(self, source: _Source) -> None:
        try:
            await self._read_source(source)
        finally:
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(_WAKE)

    async def _read_source(self, source: _Source) -> None:
        delay = RETRY_MIN_S
        refresh = False
        while True:
            try:
                try:
                    address = await self._address(source.node, refresh=refresh)
                except TrainyardError as exc:
                    raise LookupFailed(exc.message) from exc
                if not address:
                    raise NotRegistered(f"node {source.node} is not registered with the scheduler any more")
                slots = self._node_slots.setdefault(source.node, asyncio.Semaphore(OPEN_PER_NODE))
                async with slots:
                    await self._stream(source, address)
                known, running = await workers_known(self.agents, address, node_id=source.node,
                                                     job_id=self.query.job_id, attempt=source.attempt,
                                                     timeout_s=self.timeout_s)
                source.failures, refresh = 0, False
                # Still running: the stream ended while its workers were being started; open it again.
                if not running and (known or source.lines or attempt_over(self.job, source.attempt)):
                    return
            except NotFound:
                source.failures = 0
                if attempt_over(self.job, source.attempt):
                    return  # this node has no logs of that attempt (never launched, or its state is gone)
            except TrainyardError as exc:
                source.failures += 1
                refresh = True
                if source.failures == 1:
                    await self._queue.put(_Note(self._warning(source, exc)))
                if JobState(self.job.state).terminal and source.failures >= GIVE_UP_AFTER:
                    return
            await self._wait_change(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    def _warning(self, source: _Source, exc: TrainyardError) -> Event:
        if isinstance(exc, LookupFailed) and not self.query.show_addresses:
            reason = f"the scheduler cannot say where the agent of {source.node} is right now"
        else:
            reason = joblogs.failure(exc, source.node, self.query.show_addresses or isinstance(exc, NotRegistered))
        ranks = [r for r in source.ranks if not self.query.ranks or r in self.query.ranks]
        return Event("warning", {"node": source.node, "attempt": source.attempt, "ranks": ranks,
                                 "message": f"no logs for ranks {joblogs.rank_ranges(ranks) or '?'} of attempt "
                                            f"{source.attempt} on node {source.node} for now: {reason}; retrying"})

    def _request(self, source: _Source) -> Any:
        """What to ask the source's agent for: after the seqs already sent of its attempt, or (a first
        connection with `tail`, before any line came) the tail; never lines before `since`."""
        after = {rank: seq for (attempt, rank), seq in self._queued.items() if attempt == source.attempt and seq}
        tail = self.query.tail if source.tail and not source.lines and not after else 0
        return logs_request(job_id=self.query.job_id, attempt=source.attempt, tail_lines=tail,
                            since_ms=joblogs.unix_ms(self.query.since), after_seq=after)

    async def _stream(self, source: _Source, address: str) -> None:
        seen: dict[int, int] = {}
        ranks = self.query.ranks
        async for batch in stream_worker_logs(self.agents, address, node_id=source.node,
                                              request=self._request(source)):
            fresh = []
            for line in batch:
                if line.attempt != source.attempt or (ranks and line.rank not in ranks):
                    continue
                seen[line.rank] = seen.get(line.rank, 0) + 1
                if not line.seq:
                    # An agent from before line numbers (it ignored after_seq too): its lines' positions.
                    line = replace(line, seq=seen[line.rank])
                key = (line.attempt, line.rank)
                if line.seq <= self._queued.get(key, 0):
                    continue  # sent before this stream was opened (only an agent without after_seq sends it)
                self._queued[key] = line.seq
                fresh.append(line)
            if fresh:
                source.lines += len(fresh)
                source.failures = 0
                await self._queue.put(_Lines(source.node, fresh))

    # the events

    async def events(self) -> AsyncIterator[Event]:
        self._add_sources(at_start=True)
        self._spawn(self._watch())
        warned_ids = False
        try:
            while True:
                if self._queue.empty() and self._over():
                    yield self._end()
                    return
                item = await self._queue.get()
                if isinstance(item, _Lines):
                    self._mark_starts(item.lines)
                    for line in item.lines:
                        self._ids.set((line.attempt, line.rank), line.seq)
                        ident = self._ids.text()
                        if len(ident) > MAX_ID_LENGTH:
                            ident = ""
                            if not warned_ids:
                                warned_ids = True
                                yield Event("warning", {"node": "", "attempt": line.attempt, "ranks": [],
                                                        "message": "too many ranks to resume: events carry no id "
                                                                   "from here on; follow fewer ranks (?rank=)"})
                        yield Event("line", {"rank": line.rank, "attempt": line.attempt, "node": item.node,
                                             "stream": line.stream, "time": _time(line.time_ms),
                                             "text": line.text.removesuffix("\n")}, id=ident)
                elif isinstance(item, _Note):
                    yield item.event
        finally:
            self.close()

    def _mark_starts(self, lines: list[LogLine]) -> None:
        """Ranks first seen in `lines` enter the ids at one before their first seq: nothing before it comes
        from this stream (the tail, `since`, or rotation left it out), and a resume must not ask for it."""
        started: set[Key] = set()
        for line in lines:
            key = (line.attempt, line.rank)
            if key not in started:
                started.add(key)
                if not self._ids.get(key):
                    self._ids.set(key, line.seq - 1)

    def _end(self) -> Event:
        job = self.job
        ident = self._ids.text()
        return Event("end", {"state": job.state, "exit_code": job.exit_code, "message": job.message},
                     id=ident if len(ident) <= MAX_ID_LENGTH else "")

    def close(self) -> None:
        """Cancel every task (idempotent): their agent and scheduler calls are cancelled with them."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()


def _time(ms: int) -> str | None:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds") if ms else None


class NotRegistered(TrainyardError):
    """A node of the job that the scheduler no longer lists (no address to ask)."""


class LookupFailed(TrainyardError):
    """The scheduler could not be asked for the node's agent address (its message may name a replica's
    address: operators only)."""
