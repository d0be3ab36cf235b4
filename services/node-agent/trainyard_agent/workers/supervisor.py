"""Worker supervision: start a gang's processes on this node, watch them, stop them, report their exits.

State of one worker (one process group, led by the worker process):

    RUNNING ──(process ends by itself)───────────────▶ EXITED ──(scheduler acks)──▶ REPORTED
       │                                                 ▲
       └─(stop: SIGTERM group, grace, SIGKILL group)─────┘

- RUNNING: the process was started in a new session (pgid == pid); a supervise task reads its stdout
  and stderr into the rank's log file and waits for it.
- EXITED: the leader was reaped. What is left of its group is SIGKILLed (nothing outlives a worker),
  output is drained (bounded: a descendant that escaped the group could hold the pipe forever), the
  exit is written to the record file, then handed to the `ExitSink` (the reporter), which retries
  until the scheduler acknowledges.
- REPORTED: the sink called `mark_reported`; the record file says so, a later agent life will not
  report it again.

An allocation is the workers of one (job_id, attempt) on this node. Launch is idempotent per key: a
retried launch (in memory, or found in the record files of an earlier life) starts nothing and answers
`already_running=True`. Stop is idempotent: concurrent stops of one allocation wait for the same
termination; stopping unknown or finished workers stops nothing.

Writers: only the event loop touches this state. Record files: `records.py`. Logs: `logs.py`.

Previous lives (`recover()`, run once at start-up before serving): for every record with workers that
have no exit yet, a worker whose leader still runs (same pid *and* start time) or whose group still has
members is stopped like a StopWorkers call (SIGTERM, grace, SIGKILL) and reported with the signal that
ended it; one that is already gone is reported with exit_code -1 (EXIT_UNKNOWN: it ended while no agent
watched, its status is lost). Unacknowledged exits are reported again. Adopting live workers instead of
stopping them needs their output to survive the agent (a log shim) and is left to a later issue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from trainyard_core.clock import Clock, SystemClock
from trainyard_core.errors import FailedPrecondition, InvalidArgument
from trainyard_core.logs import log_context

from .. import metrics
from ..model import Health, RunningAllocation, Vendor
from ..notify import Notifier
from . import logs, process, records
from .env import worker_env
from .fence import LeaderFence
from .model import (
    EXIT_UNKNOWN,
    LaunchRequest,
    LaunchResult,
    LogLine,
    LogQuery,
    Stream,
    WorkerExit,
    WorkerSpec,
    WorkerStatus,
    check_job_id,
    exit_status,
)

log = logging.getLogger(__name__)

# After a leader exits, how long its output may still be drained before the pipes are abandoned.
DRAIN_TIMEOUT_S = 5.0
# After SIGKILL, how long to wait for the kernel to take processes away (D state can delay it).
KILL_WAIT_S = 10.0
# Finished allocations kept in memory for ListWorkers; older ones live on in their record files.
KEEP_FINISHED = 256
# Largest GetWorkerLogs answer, well below the 64 MiB gRPC message limit.
MAX_LOG_ANSWER_BYTES = 32 * 1024 * 1024


class ExitSink(Protocol):
    """Receives worker exits to report. `submit` must not block; the same exit may come twice."""

    def submit(self, exit: WorkerExit) -> None: ...


class NoSink:
    def submit(self, exit: WorkerExit) -> None:
        log.debug("exit not reported (no sink)", extra={"rank": exit.rank})


@dataclass
class _Worker:
    spec: WorkerSpec
    record: records.WorkerRecord
    # Process and log file of a worker this agent life started; None for workers of a previous life.
    proc: asyncio.subprocess.Process | None = None
    log: logs.RankLog | None = None
    exit: WorkerExit | None = None
    task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.exit is None


@dataclass
class _Allocation:
    job_id: str
    attempt: int
    dir: Path
    record: records.AllocationRecord
    workers: list[_Worker] = field(default_factory=list)
    stop_task: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)

    @property
    def running(self) -> bool:
        return any(w.running for w in self.workers)

    def save(self) -> None:
        """Persist the record; a failure is logged (the exit is still reported from memory, but a later
        agent life would not know it was)."""
        try:
            records.save(self.dir / records.RECORD_NAME, self.record)
        except OSError as exc:
            log.error("cannot update the worker record", extra={"path": str(self.dir), "error": str(exc)})


class Supervisor:
    def __init__(
        self,
        *,
        state_dir: Path,
        node_id: str,
        vendor: Vendor,
        gpu_health: Callable[[], list[tuple[Health, str]]],
        base_env: Mapping[str, str],
        site_env: Mapping[str, str],
        stop_grace_s: float,
        log_max_bytes: int,
        log_backups: int,
        fence: LeaderFence | None = None,
        exits: ExitSink | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.jobs_root = state_dir / "jobs"
        self.jobs_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._node_id = node_id
        self._vendor = vendor
        self._gpu_health = gpu_health
        self._base_env = dict(base_env)
        self._site_env = dict(site_env)
        self._stop_grace_s = stop_grace_s
        self._log_max_bytes = log_max_bytes
        self._log_backups = log_backups
        self.fence = fence or LeaderFence()
        self.exits: ExitSink = exits or NoSink()
        self._clock = clock or SystemClock()
        self._allocs: dict[tuple[str, int], _Allocation] = {}
        self._lock = asyncio.Lock()
        # Wakes log followers and anyone waiting for workers to start or end.
        self.changes = Notifier()

    # --- launch ----------------------------------------------------------------------------------------

    async def launch(self, req: LaunchRequest) -> LaunchResult:
        req.validate()
        with log_context(job_id=req.job_id, attempt=req.attempt):
            async with self._lock:
                self.fence.check(req.leader_epoch)
                existing = self._existing(req.job_id, req.attempt)
                if existing is not None:
                    log.info("launch retried; workers already started")
                    return LaunchResult(pids=existing, already_running=True)
                self._check_gpus(req)
                cwd = self._working_dir(req)
                adir = logs.attempt_dir(self.jobs_root, req.job_id, req.attempt)
                try:
                    adir.mkdir(parents=True, exist_ok=True, mode=0o700)
                except OSError as exc:
                    raise FailedPrecondition(f"node {self._node_id} cannot create {adir}: {exc.strerror}") from exc
                alloc = await self._spawn(req, adir, cwd)
                self._allocs[alloc.key] = alloc
                self._prune()
            for w in alloc.workers:
                w.task = asyncio.create_task(self._supervise(alloc, w), name=f"worker-{req.job_id}-{w.spec.rank}")
            self._publish()
            log.info("workers started", extra={"pids": [w.record.pid for w in alloc.workers],
                                               "ranks": [w.spec.rank for w in alloc.workers], "cwd": cwd})
            return LaunchResult(pids=tuple(w.record.pid for w in alloc.workers), already_running=False)

    def _existing(self, job_id: str, attempt: int) -> tuple[int, ...] | None:
        alloc = self._allocs.get((job_id, attempt))
        if alloc is not None:
            return tuple(w.record.pid for w in alloc.workers)
        rec = records.load(logs.attempt_dir(self.jobs_root, job_id, attempt) / records.RECORD_NAME)
        if rec is not None:
            return tuple(w.pid for w in rec.workers)
        return None

    def _check_gpus(self, req: LaunchRequest) -> None:
        health = self._gpu_health()
        busy = {gpu: alloc.key for alloc in self._allocs.values() for w in alloc.workers if w.running
                for gpu in w.spec.gpu_indices}
        for w in req.workers:
            for gpu in w.gpu_indices:
                if not 0 <= gpu < len(health):
                    has = f"GPUs 0-{len(health) - 1}" if health else "no GPUs"
                    raise InvalidArgument(f"rank {w.rank} asks for GPU {gpu}, but node {self._node_id} has {has}")
                state, reason = health[gpu]
                if state is Health.UNHEALTHY:
                    raise FailedPrecondition(f"GPU {gpu} of node {self._node_id} is unhealthy: {reason}")
                if gpu in busy:
                    job, attempt = busy[gpu]
                    raise FailedPrecondition(f"GPU {gpu} of node {self._node_id} is in use by job {job} "
                                             f"attempt {attempt}")

    def _working_dir(self, req: LaunchRequest) -> str:
        if req.working_dir:
            path = Path(req.working_dir)
            if not path.is_absolute():
                raise InvalidArgument(f"working_dir {req.working_dir!r} must be an absolute path")
            if not path.is_dir():
                raise InvalidArgument(f"working_dir {req.working_dir} does not exist on node {self._node_id}")
            return str(path)
        # Shared by the job's attempts, so a restarted attempt finds what the previous one left.
        path = logs.job_dir(self.jobs_root, req.job_id) / "work"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FailedPrecondition(f"node {self._node_id} cannot create {path}: {exc.strerror}") from exc
        return str(path)

    async def _spawn(self, req: LaunchRequest, adir: Path, cwd: str) -> _Allocation:
        """Start every worker or none: a gang with a missing rank would hang in its first collective."""
        rec = records.AllocationRecord(job_id=req.job_id, attempt=req.attempt, node_id=self._node_id,
                                       created_at=self._clock.now())
        alloc = _Allocation(job_id=req.job_id, attempt=req.attempt, dir=adir, record=rec)
        try:
            for spec in req.workers:
                # Opened first: a worker whose output could not be kept is not started.
                rank_log = logs.RankLog(logs.rank_log_path(adir, spec.rank), max_bytes=self._log_max_bytes,
                                        backups=self._log_backups)
                env = worker_env(base=self._base_env, site_defaults=self._site_env, request_env=req.env,
                                 worker=spec, vendor=self._vendor, node_id=self._node_id)
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *req.command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE, cwd=cwd, env=env, start_new_session=True)
                except OSError as exc:
                    rank_log.close()
                    raise InvalidArgument(f"cannot start {req.command[0]!r} in {cwd}: "
                                          f"{exc.strerror or exc}") from exc
                wrec = records.WorkerRecord(rank=spec.rank, local_rank=spec.local_rank,
                                            gpu_indices=list(spec.gpu_indices), pid=proc.pid, pgid=proc.pid,
                                            start_time=process.start_time(proc.pid))
                rec.workers.append(wrec)
                alloc.workers.append(_Worker(spec=spec, record=wrec, proc=proc, log=rank_log))
            # Before anyone is told the workers run: a later agent life finds them through this file.
            records.save(adir / records.RECORD_NAME, rec)
        except BaseException as exc:
            await self._kill_spawned(alloc)
            if isinstance(exc, OSError):
                raise FailedPrecondition(f"node {self._node_id} cannot keep the workers' logs or records under "
                                         f"{adir}: {exc.strerror or exc}") from exc
            raise
        return alloc

    async def _kill_spawned(self, alloc: _Allocation) -> None:
        for w in alloc.workers:
            process.signal_group(w.record.pgid, signal.SIGKILL)
        for w in alloc.workers:
            if w.proc is not None:
                await w.proc.communicate()
            if w.log is not None:
                w.log.close()

    # --- supervise ---------------------------------------------------------------------------------------

    async def _supervise(self, alloc: _Allocation, w: _Worker) -> None:
        proc = w.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        rank_log = w.log
        assert rank_log is not None
        with log_context(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank):
            pumps = [asyncio.create_task(self._pump(proc.stdout, Stream.STDOUT, rank_log)),
                     asyncio.create_task(self._pump(proc.stderr, Stream.STDERR, rank_log))]
            try:
                returncode = await process.wait_for_exit(proc)
                # Nothing may outlive its worker: dataloader children, shell pipelines, ...
                if process.group_alive(w.record.pgid):
                    process.signal_group(w.record.pgid, signal.SIGKILL)
                _done, pending = await asyncio.wait(pumps, timeout=DRAIN_TIMEOUT_S)
                for task in pending:
                    log.warning("worker output still open after it exited; abandoning it")
                    task.cancel()
            finally:
                for task in pumps:
                    task.cancel()
                rank_log.close()
            code, sig = exit_status(returncode)
            self._record_exit(alloc, w, code, sig)

    async def _pump(self, reader: asyncio.StreamReader, stream: Stream, rank_log: logs.RankLog) -> None:
        splitter = logs.LineSplitter()
        while chunk := await reader.read(64 * 1024):
            self._write(rank_log, stream, splitter.feed(chunk))
        self._write(rank_log, stream, splitter.finish())

    def _write(self, rank_log: logs.RankLog, stream: Stream, lines: list[bytes]) -> None:
        # A full or failing disk loses log lines, never the worker: the pipe is drained either way, or the
        # worker would block on its next print once the pipe buffer fills.
        try:
            for line in lines:
                rank_log.write(stream, line)
            rank_log.flush()
        except (OSError, ValueError) as exc:  # ValueError: the file could not be reopened after a rotation
            if not rank_log.failed:
                log.error("cannot write the worker's log; its output is dropped until the file is writable",
                          extra={"path": str(rank_log.path), "error": str(exc)})
            rank_log.failed = True
        else:
            rank_log.failed = False
        self.changes.notify()

    def _record_exit(self, alloc: _Allocation, w: _Worker, code: int, sig: int) -> None:
        exited_at = self._clock.now()
        w.exit = WorkerExit(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank, exit_code=code,
                            signal=sig, exited_at=exited_at)
        w.record.exit_code, w.record.signal, w.record.exited_at = code, sig, exited_at
        alloc.save()
        outcome = "signal" if sig else ("success" if code == 0 else "failure")
        metrics.WORKER_EXITS.labels(self._node_id, outcome).inc()
        log.info("worker exited", extra={"job_id": alloc.job_id, "attempt": alloc.attempt, "rank": w.spec.rank,
                                         "exit_code": code, "signal": sig})
        self.exits.submit(w.exit)
        self._publish()

    def mark_reported(self, exit: WorkerExit) -> None:
        """The scheduler acknowledged `exit`: remember it so no later life reports it again."""
        alloc = self._allocs.get((exit.job_id, exit.attempt))
        if alloc is None:
            path = logs.attempt_dir(self.jobs_root, exit.job_id, exit.attempt) / records.RECORD_NAME
            rec = records.load(path)
            if rec is not None:
                for wr in rec.workers:
                    wr.reported = wr.reported or wr.rank == exit.rank
                _Allocation(exit.job_id, exit.attempt, path.parent, rec).save()
            return
        for w in alloc.workers:
            if w.spec.rank == exit.rank and not w.record.reported:
                w.record.reported = True
                alloc.save()

    # --- stop --------------------------------------------------------------------------------------------

    async def stop(self, job_id: str, attempt: int, grace_s: float | None = None) -> int:
        """Stop the workers of (job_id, attempt), or of every attempt when attempt is 0.

        Returns how many were running. Returns only when every process of their groups is gone (or
        KILL_WAIT_S after SIGKILL, for processes stuck in the kernel) and their exits are recorded.
        """
        check_job_id(job_id)
        grace = self._stop_grace_s if grace_s is None else grace_s
        async with self._lock:
            allocs = [a for a in self._allocs.values()
                      if a.job_id == job_id and (attempt == 0 or a.attempt == attempt)]
        with log_context(job_id=job_id):
            counts = await asyncio.gather(*(self._stop_alloc(a, grace) for a in allocs))
        return sum(counts)

    async def _stop_alloc(self, alloc: _Allocation, grace: float) -> int:
        if alloc.stop_task is not None and not alloc.stop_task.done():
            await asyncio.shield(alloc.stop_task)
            return 0
        running = [w for w in alloc.workers if w.running]
        if not running:
            return 0
        log.info("stopping workers", extra={"attempt": alloc.attempt, "ranks": [w.spec.rank for w in running],
                                            "grace_s": grace})
        alloc.stop_task = asyncio.create_task(self._terminate(running, grace))
        await asyncio.shield(alloc.stop_task)
        return len(running)

    async def _terminate(self, workers: list[_Worker], grace: float) -> None:
        pgids = {w.record.pgid for w in workers}
        for pgid in pgids:
            process.signal_group(pgid, signal.SIGTERM)
        left = await process.wait_groups_gone(pgids, grace)
        if left:
            log.warning("workers ignored SIGTERM for the grace period; killing", extra={"pgids": sorted(left)})
            for pgid in left:
                process.signal_group(pgid, signal.SIGKILL)
            stuck = await process.wait_groups_gone(left, KILL_WAIT_S)
            if stuck:
                log.error("processes survive SIGKILL (stuck in the kernel?)", extra={"pgids": sorted(stuck)})
        # The supervise tasks record the exits; wait for them so the caller sees the exits recorded.
        tasks = [w.task for w in workers if w.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S + 1)

    # --- previous lives ------------------------------------------------------------------------------------

    async def recover(self) -> list[WorkerExit]:
        """Stop and report the workers of an earlier agent life (see the module docstring).

        Returns the exits handed to the sink (recorded now, or recorded earlier but not acknowledged).
        """
        found: list[_Allocation] = []
        for path in records.find_all(self.jobs_root):
            rec = records.load(path)
            if rec is None or (rec.job_id, rec.attempt) in self._allocs:
                continue
            alloc = _Allocation(job_id=rec.job_id, attempt=rec.attempt, dir=path.parent, record=rec)
            for wr in rec.workers:
                w = _Worker(spec=WorkerSpec(wr.rank, wr.local_rank, tuple(wr.gpu_indices)), record=wr)
                if wr.exit_code is not None:
                    w.exit = WorkerExit(rec.job_id, rec.attempt, wr.rank, wr.exit_code, wr.signal or 0,
                                        wr.exited_at or 0.0)
                alloc.workers.append(w)
            found.append(alloc)
        await asyncio.gather(*(self._stop_leftovers(a) for a in found))
        submitted: list[WorkerExit] = []
        for alloc in found:
            self._allocs[alloc.key] = alloc
            for w in alloc.workers:
                if w.exit is not None and not w.record.reported:
                    self.exits.submit(w.exit)
                    submitted.append(w.exit)
        self._prune()
        self._publish()
        return submitted

    async def _stop_leftovers(self, alloc: _Allocation) -> None:
        pending = [w for w in alloc.workers if w.running]
        if not pending:
            return
        with log_context(job_id=alloc.job_id, attempt=alloc.attempt):
            alive = [w for w in pending if _still_ours(w.record)]
            if alive:
                log.warning("workers of a previous agent life are still running; stopping them",
                            extra={"ranks": [w.spec.rank for w in alive]})
                pgids = {w.record.pgid for w in alive}
                for pgid in pgids:
                    process.signal_group(pgid, signal.SIGTERM)
                killed = await process.wait_groups_gone(pgids, self._stop_grace_s)
                for pgid in killed:
                    process.signal_group(pgid, signal.SIGKILL)
                await process.wait_groups_gone(killed, KILL_WAIT_S)
            now = self._clock.now()
            for w in pending:
                if w in alive:
                    sig = int(signal.SIGKILL if w.record.pgid in killed else signal.SIGTERM)
                    code = 128 + sig
                else:
                    code, sig = EXIT_UNKNOWN, 0
                w.record.exit_code, w.record.signal, w.record.exited_at = code, sig, now
                w.exit = WorkerExit(alloc.job_id, alloc.attempt, w.spec.rank, code, sig, now)
                log.info("worker of a previous agent life ended", extra={"rank": w.spec.rank, "exit_code": code,
                                                                          "signal": sig})
            alloc.save()

    # --- queries -------------------------------------------------------------------------------------------

    def list_workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(job_id=a.job_id, attempt=a.attempt, rank=w.spec.rank, pid=w.record.pid,
                             running=w.running, exit_code=w.exit.exit_code if w.exit else 0,
                             signal=w.exit.signal if w.exit else 0)
                for a in self._allocs.values() for w in a.workers]

    def running_allocations(self) -> list[RunningAllocation]:
        return [RunningAllocation(a.job_id, a.attempt, tuple(w.spec.rank for w in a.workers if w.running))
                for a in self._allocs.values() if a.running]

    def running_count(self) -> int:
        return sum(1 for a in self._allocs.values() for w in a.workers if w.running)

    async def read_logs(self, query: LogQuery) -> list[LogLine]:
        # Reading tens of MiB must not stall the event loop (heartbeats, launches): a worker thread reads.
        return await asyncio.to_thread(logs.read_logs, self.jobs_root, query, max_bytes=MAX_LOG_ANSWER_BYTES)

    async def follow_logs(self, query: LogQuery) -> AsyncIterator[list[LogLine]]:
        """Retained lines, then new ones as they are written, until no matching worker runs here."""
        logs.require_job(self.jobs_root, query)
        follower = logs.LogFollower(self.jobs_root, query)
        try:
            while True:
                version = self.changes.version
                finished = not any(a.running for a in self._allocs.values() if a.job_id == query.job_id
                                   and (query.attempt == 0 or a.attempt == query.attempt))
                lines = await asyncio.to_thread(follower.poll)
                if lines:
                    yield lines
                elif finished:
                    return
                if not follower.more and self.changes.version == version:
                    # The timeout only guards against a missed wake-up; changes normally wake us.
                    await self.changes.wait(timeout=1.0)
        finally:
            follower.close()

    # --- shutdown ------------------------------------------------------------------------------------------

    async def close(self, *, kill: bool = False) -> None:
        """Stop supervising. With `kill`, stop every running worker first (exits are recorded and
        submitted); without, workers keep running and the next agent life deals with them."""
        if kill:
            await asyncio.gather(*(self._stop_alloc(a, self._stop_grace_s) for a in list(self._allocs.values())))
        tasks = [w.task for a in self._allocs.values() for w in a.workers if w.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _publish(self) -> None:
        metrics.WORKERS_RUNNING.labels(self._node_id).set(self.running_count())
        self.changes.notify()

    def _prune(self) -> None:
        finished = [k for k, a in self._allocs.items()
                    if not a.running and all(w.record.reported for w in a.workers)]
        for key in finished[:max(0, len(finished) - KEEP_FINISHED)]:
            del self._allocs[key]


def _still_ours(rec: records.WorkerRecord) -> bool:
    """Whether a recorded worker (or what is left of its process group) still runs."""
    started = process.start_time(rec.pid)
    if started is not None:
        # The pid is taken: by our worker only if it started at the same tick.
        return rec.start_time is not None and started == rec.start_time
    # Leader gone: members of its group may remain. No other group can hold that id while the pid is free.
    return process.group_alive(rec.pgid)
