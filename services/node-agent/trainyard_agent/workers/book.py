"""The worker book: the allocations this agent life knows, how each worker's end is found out and
recorded, and the read-only views of them (ListWorkers, heartbeats, metrics).

Separate from `supervisor.py`, which acts on workers (launch, stop, recovery): this keeps the account of
them. A worker's end is recorded the same way whoever started it (a launch of this life, or one adopted
from a previous life), written to its record file, handed to the `ExitSink` and published.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from trainyard_core.clock import Clock
from trainyard_core.logs import log_context

from .. import metrics
from ..model import RunningAllocation
from ..notify import Notifier
from . import credentials, logs, logwriter, process, records, shim, spawn
from .allocation import Allocation, Worker
from .model import EXIT_UNKNOWN, WorkerExit, WorkerStatus, exit_status
from .stopping import end_groups

log = logging.getLogger(__name__)

# Finished allocations kept in memory for ListWorkers; older ones live on in their record files.
KEEP_FINISHED = 256


class ExitSink(Protocol):
    """Receives worker exits to report. `submit` must not block; the same exit may come twice."""

    def submit(self, exit: WorkerExit) -> None: ...


class NoSink:
    def submit(self, exit: WorkerExit) -> None:
        log.debug("exit not reported (no sink)", extra={"rank": exit.rank})


class WorkerBook:
    """The allocations of this node, by (job_id, attempt). `allocs` is the supervisor's too: it adds
    what it launches or finds, the book prunes finished ones. Only the event loop touches it."""

    def __init__(self, *, node_id: str, jobs_root: Path, workdir_root: Path, exits: ExitSink, clock: Clock,
                 stop_grace_s: float, log_max_bytes: int, log_backups: int, changes: Notifier) -> None:
        self._node_id = node_id
        self._jobs_root = jobs_root
        self._workdir_root = workdir_root
        self.exits = exits
        self._clock = clock
        self._stop_grace_s = stop_grace_s
        self._log_max_bytes = log_max_bytes
        self._log_backups = log_backups
        self._changes = changes
        self.allocs: dict[tuple[str, int], Allocation] = {}
        # Set by the supervisor's close(kill=True): the exits recorded from then on are the agent's shutdown's
        # doing.
        self.shutting_down = False

    def existing(self, job_id: str, attempt: int) -> tuple[int, ...] | None:
        alloc = self.allocs.get((job_id, attempt))
        if alloc is not None:
            return tuple(w.record.pid for w in alloc.workers)
        rec = records.load(logs.attempt_dir(self._jobs_root, job_id, attempt) / records.RECORD_NAME)
        if rec is not None:
            return tuple(w.pid for w in rec.workers)
        return None

    # --- exits -------------------------------------------------------------------------------------------

    async def supervise(self, alloc: Allocation, w: Worker) -> None:
        with log_context(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank):
            if w.shim is not None:
                await process.wait_for_exit(w.shim)
            else:
                await process.wait_gone(w.record.shim_pid, w.record.shim_start_time)
            await self.settle(alloc, w)

    async def settle(self, alloc: Allocation, w: Worker) -> None:
        """Record the end of `w`, whose shim has ended."""
        status = shim.read_status(records.status_path(alloc.dir, w.spec.rank))
        if status is not None:
            returncode, exited_at = status
            code, sig = exit_status(returncode)
        else:
            code, sig = await self._unknown_end(alloc, w)
            exited_at = self._clock.now()
        self._record_exit(alloc, w, code, sig, exited_at)

    async def _unknown_end(self, alloc: Allocation, w: Worker) -> tuple[int, int]:
        """(exit_code, signal) of a worker whose shim recorded no end: stop what is left of it (nobody reads
        its output any more), then report the signal of that stop, or EXIT_UNKNOWN."""
        if w.record.shim_pid is None:
            why = "it was started by an agent without shims, and its output went to that agent"
        else:
            why = "its shim ended without recording it" + _complaints(records.shim_err_path(alloc.dir, w.spec.rank))
        if _still_ours(w.record):
            log.warning("a worker runs on without its shim; stopping it", extra={"reason": why})
            await end_groups([w], self._stop_grace_s)
        if w.stop_signal:
            code, sig = 128 + w.stop_signal, w.stop_signal
        else:
            code, sig = EXIT_UNKNOWN, 0
        log.warning("the worker's exit status is unknown", extra={"reason": why, "exit_code": code, "signal": sig})
        self._note(alloc, w, f"[exit status unknown: {why}; reported as exit code {code}]")
        return code, sig

    def _note(self, alloc: Allocation, w: Worker, text: str) -> None:
        """Append an agent line to the worker's log (only once its shim, the log's writer, has ended)."""
        try:
            rank_log = logwriter.RankLog(logs.rank_log_path(alloc.dir, w.spec.rank), max_bytes=self._log_max_bytes,
                                         backups=self._log_backups)
            try:
                rank_log.write("agent", text.encode()[:rank_log.max_line])
            finally:
                rank_log.close()
        except (OSError, ValueError) as exc:
            log.error("cannot write to the worker's log", extra={"error": str(exc)})

    def _record_exit(self, alloc: Allocation, w: Worker, code: int, sig: int, exited_at: float) -> None:
        w.exit = WorkerExit(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank, exit_code=code,
                            signal=sig, exited_at=exited_at, agent_shutdown=self.shutting_down)
        w.record.exit_code, w.record.signal, w.record.exited_at = code, sig, exited_at
        w.record.agent_shutdown = self.shutting_down
        alloc.save()
        if not alloc.running:
            # Nothing here reads the attempt's credential any more (a restarted attempt gets its own).
            credentials.remove(credentials.job_dir(self._workdir_root, alloc.job_id), alloc.attempt)
        outcome = "signal" if sig else ("success" if code == 0 else "failure")
        metrics.WORKER_EXITS.labels(self._node_id, outcome).inc()
        log.info("worker exited", extra={"job_id": alloc.job_id, "attempt": alloc.attempt, "rank": w.spec.rank,
                                         "exit_code": code, "signal": sig})
        self.exits.submit(w.exit)
        self.publish()

    def mark_reported(self, exit: WorkerExit) -> None:
        """The scheduler acknowledged `exit`: remember it so no later life reports it again."""
        alloc = self.allocs.get((exit.job_id, exit.attempt))
        if alloc is None:
            path = logs.attempt_dir(self._jobs_root, exit.job_id, exit.attempt) / records.RECORD_NAME
            rec = records.load(path)
            if rec is not None:
                for wr in rec.workers:
                    wr.reported = wr.reported or wr.rank == exit.rank
                Allocation(exit.job_id, exit.attempt, path.parent, rec).save()
            return
        for w in alloc.workers:
            if w.spec.rank == exit.rank and not w.record.reported:
                w.record.reported = True
                alloc.save()

    def publish(self) -> None:
        metrics.WORKERS_RUNNING.labels(self._node_id).set(self.running_count())
        metrics.set_gpu_holders(self._node_id, self.gpu_holders())
        self._changes.notify()

    def prune(self) -> None:
        finished = [k for k, a in self.allocs.items()
                    if not a.running and all(w.record.reported for w in a.workers)]
        for key in finished[:max(0, len(finished) - KEEP_FINISHED)]:
            del self.allocs[key]

    # --- views -------------------------------------------------------------------------------------------

    def list_workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(job_id=a.job_id, attempt=a.attempt, rank=w.spec.rank, pid=w.record.pid,
                             running=w.running, exit_code=w.exit.exit_code if w.exit else 0,
                             signal=w.exit.signal if w.exit else 0)
                for a in self.allocs.values() for w in a.workers]

    def running_allocations(self) -> list[RunningAllocation]:
        return [RunningAllocation(a.job_id, a.attempt, tuple(w.spec.rank for w in a.workers if w.running))
                for a in self.allocs.values() if a.running]

    def running_count(self) -> int:
        return sum(1 for a in self.allocs.values() for w in a.workers if w.running)

    def gpu_holders(self) -> dict[int, metrics.GpuHolder]:
        """The GPUs running workers hold, and whose they are (job and team)."""
        return {gpu: metrics.GpuHolder(a.job_id, a.record.team) for a in self.allocs.values() for w in a.workers
                if w.running for gpu in w.spec.gpu_indices}


def _still_ours(rec: records.WorkerRecord) -> bool:
    """Whether a recorded worker (or what is left of its process group) still runs."""
    started = process.start_time(rec.pid)
    if started is not None:
        # The pid is taken: by our worker only if it started at the same tick.
        return rec.start_time is not None and started == rec.start_time
    # Leader gone: members of its group may remain. No other group can hold that id while the pid is free.
    return process.group_alive(rec.pgid)


def _complaints(err_path: Path) -> str:
    """The end of what a shim wrote to its stderr file, for the log."""
    text = spawn.shim_stderr_tail(err_path, 300)
    return f" (it said: {text})" if text else ""
