"""Worker supervision: start a gang's processes on this node, watch them, stop them, report their exits.

Every worker runs under its shim (`shim.py`), which started it, writes its output to the rank's log and
records its end in a status file. The agent starts the shims (`spawn.py`), waits for them to end and
reads what they recorded, so workers need nothing from the agent while they run and a restarted agent
can take them over.

State of one worker (one process group, led by the worker process):

    RUNNING ──(process ends by itself)───────────────▶ EXITED ──(scheduler acks)──▶ REPORTED
       │                                                 ▲
       └─(stop: SIGTERM group, grace, SIGKILL group)─────┘

- RUNNING: the shim started the worker in a new session (pgid == pid); a supervise task waits for the
  shim to end.
- EXITED: the shim ended. It reaped the worker, SIGKILLed what was left of its group (nothing outlives
  a worker), drained its output (bounded) and recorded the status, which the agent writes to the record
  file and hands to the `ExitSink` (the reporter), which retries until the scheduler acknowledges. A
  shim that ended without a status (killed, crashed) leaves the worker's status unknown: what is left of
  its group is stopped, and the exit is reported as EXIT_UNKNOWN (-1), or as the signal of a stop that
  was under way; the reason is logged and written to the rank's log.
- REPORTED: the sink called `mark_reported`; the record file says so, a later agent life will not
  report it again.

An allocation is the workers of one (job_id, attempt) on this node. Launch is idempotent per key: a
retried launch (in memory, or found in the record files of an earlier life) starts nothing and answers
`already_running=True`. A launch starts every worker or none: the record is saved once all run, then
each shim is told to commit; a shim not told (the launch failed, or the agent died during it) kills its
worker. Stop is idempotent: concurrent stops of one allocation wait for the same termination; stopping
unknown or finished workers stops nothing.

Tenants: a launch runs as the Unix identity the agent's `Tenancy` gives its team (refused with
FAILED_PRECONDITION when it has none), in `<workdir_root>/<job_id>` owned by that identity unless the job
names a working_dir; logs, records and status files stay the agent's (`tenancy.py` says why).

The attempt's checkpoint-store credential: a launch's env carries it as PEM; the workers get the paths of
files under the job's directory instead (`credentials.py`), which `renew_credential` (RenewJobCredential)
replaces while the attempt runs here and which go when its last worker here has ended.

Writers: only the event loop touches this state. Record files: `records.py`. Logs: the shims write them,
`logs.py` reads them.

This module decides and orders; the parts live beside it: the state of allocations and workers
(`allocation.py`), carrying out a launch (`launcher.py`), watching workers and recording their exits, with
the views of them (`book.py`), stopping process groups (`stopping.py`) and taking over a previous life's
workers (`recovery.py`).

Previous lives (`recover()`, run once at start-up before serving), for every recorded worker without an
exit:
- its shim still runs (same pid *and* start time): with `RestartPolicy.ADOPT` it is supervised again as
  if this life had started it: reported as running, later its exit with its real status; with
  `RestartPolicy.STOP` it is stopped like a StopWorkers call (SIGTERM, grace, SIGKILL) and reported;
- its shim has ended: the exit is the one the shim recorded (the worker ended while no agent watched),
  or unknown, as above;
- records of agents without shims: a worker still running is stopped (its output went to the dead
  agent), one already gone is reported as unknown.
Unacknowledged exits are reported again.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from trainyard_core import telemetry
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.errors import FailedPrecondition, InvalidArgument, NotFound
from trainyard_core.logs import log_context
from trainyard_core.waits import ended

from .. import metrics
from ..model import Health, RunningAllocation, Vendor
from ..notify import Notifier
from ..tenancy import Tenancy, job_workdir, prepare_workdir_root
from . import affinity, credentials, lease, logs, logwriter, recovery, stopping
from .allocation import Allocation
from .book import ExitSink, NoSink, WorkerBook
from .fence import LeaderFence
from .launcher import Launcher
from .model import (
    LaunchRequest,
    LaunchResult,
    LogLine,
    LogQuery,
    RestartPolicy,
    WorkerExit,
    WorkerStatus,
    check_job_id,
)

log = logging.getLogger(__name__)
# A launch is a span of the job's trace (the scheduler's call carries its context); the workers' supervision
# tasks start inside it, so their log lines name the job's trace too.
_tracer = telemetry.tracer(__name__)

# Largest GetWorkerLogs answer, well below the 64 MiB gRPC message limit.
MAX_LOG_ANSWER_BYTES = 32 * 1024 * 1024
# How often a log follower looks for new lines: the shims write the files and tell the agent nothing.
FOLLOW_POLL_S = 0.1


class Supervisor:
    """Runs the workers of this node.

    `restart_policy`: what `recover()` does with workers of a previous agent life that still run; the
    agent's settings choose (`adopt` by default), `stop` here (what agents did before shims) for callers
    that do not say. `gpu_cpus`: GPU index → the CPUs close to it (its NUMA affinity); with `cpu_binding`,
    a worker is bound to the CPUs of its GPUs (`affinity.py`). `shim_python`: the interpreter that runs
    the shims, this one by default. `tenancy`: whose identity each team's workers run as (every worker as
    this process's user by default); `workdir_root`: where jobs' working directories are made
    (`<state_dir>/work` by default).
    """

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
        restart_policy: RestartPolicy | str = RestartPolicy.STOP,
        gpu_cpus: Mapping[int, Iterable[int]] | None = None,
        cpu_binding: bool = True,
        shim_python: str = sys.executable,
        tenancy: Tenancy | None = None,
        workdir_root: Path | None = None,
    ) -> None:
        if stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {stop_grace_s}")
        if log_max_bytes <= logwriter.RECORD_OVERHEAD:
            raise ValueError(f"log_max_bytes must be larger than {logwriter.RECORD_OVERHEAD}, got {log_max_bytes}")
        if log_backups < 0:
            raise ValueError(f"log_backups must be >= 0, got {log_backups}")
        self._restart_policy = RestartPolicy.parse(restart_policy)
        checked_gpu_cpus = affinity.check_gpu_cpus(gpu_cpus or {})
        self.jobs_root = state_dir / "jobs"
        self.jobs_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._tenancy = tenancy or Tenancy.single()
        self.workdir_root = workdir_root or state_dir / "work"
        prepare_workdir_root(self.workdir_root, shared=not self._tenancy.single_tenant)
        # The worker fence every shim watches (renewed by the agent's reporter; see lease.py).
        self.lease_path = state_dir / lease.LEASE_NAME
        self._node_id = node_id
        self._stop_grace_s = stop_grace_s
        self.fence = fence or LeaderFence()
        self._clock = clock or SystemClock()
        self._lock = asyncio.Lock()
        # Credential files are written one at a time: an older credential never lands after a newer one.
        self._credential_lock = asyncio.Lock()
        # Wakes log followers and anyone waiting for workers to start or end.
        self.changes = Notifier()
        self._launcher = Launcher(node_id=node_id, vendor=vendor, gpu_health=gpu_health, base_env=base_env,
                                  site_env=site_env, log_max_bytes=log_max_bytes, log_backups=log_backups,
                                  gpu_cpus=checked_gpu_cpus, cpu_binding=cpu_binding, shim_python=shim_python,
                                  workdir_root=self.workdir_root, lease_path=self.lease_path, clock=self._clock)
        self._book = WorkerBook(node_id=node_id, jobs_root=self.jobs_root, workdir_root=self.workdir_root,
                                exits=exits or NoSink(), clock=self._clock, stop_grace_s=stop_grace_s,
                                log_max_bytes=log_max_bytes, log_backups=log_backups, changes=self.changes)

    @property
    def restart_policy(self) -> RestartPolicy:
        return self._restart_policy

    @property
    def exits(self) -> ExitSink:
        return self._book.exits

    @exits.setter
    def exits(self, sink: ExitSink) -> None:
        self._book.exits = sink

    # --- launch ----------------------------------------------------------------------------------------

    async def launch(self, req: LaunchRequest) -> LaunchResult:
        req.validate()
        # A launch runs to its end even when its caller goes away (an RPC past its deadline): stopped half-way
        # it would leave shims waiting for their commit. A retry finds it done (launch is idempotent).
        task = asyncio.create_task(self._launch(req), name=f"launch-{req.job_id}-{req.attempt}")
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_log_unheard)
            raise

    async def _launch(self, req: LaunchRequest) -> LaunchResult:
        with log_context(job_id=req.job_id, attempt=req.attempt), _tracer.start_as_current_span(
                "supervisor.launch", attributes={telemetry.JOB_ID: req.job_id, telemetry.ATTEMPT: req.attempt,
                                                 telemetry.NODE_ID: self._node_id}):
            async with self._lock:
                self.fence.check(req.leader_epoch)
                cred = credentials.from_env(req.env)
                if cred is not None:
                    cred.check(req.job_id, req.attempt, self._clock.now())
                existing = self._book.existing(req.job_id, req.attempt)
                if existing is not None:
                    log.info("launch retried; workers already started")
                    running = self._book.allocs.get((req.job_id, req.attempt))
                    if cred is not None and running is not None and running.running:
                        # A new leader's launch may carry a newer credential than the workers have.
                        await self._replace_credential(running, cred)
                    return LaunchResult(pids=existing, already_running=True)
                ident = self._tenancy.identity_for(req.team)
                self._launcher.check_gpus(req, self._book.allocs.values())
                cwd = self._launcher.working_dir(req, ident)
                adir = logs.attempt_dir(self.jobs_root, req.job_id, req.attempt)
                try:
                    adir.mkdir(parents=True, exist_ok=True, mode=0o700)
                except OSError as exc:
                    raise FailedPrecondition(f"node {self._node_id} cannot create {adir}: {exc.strerror}") from exc
                if cred is not None:
                    # In the job's own directory, made for its identity even when it names a working_dir.
                    job_directory = job_workdir(self.workdir_root, req.job_id, ident)
                    await self._write_credential(req.job_id, req.attempt, cred)
                    req = replace(req, env={**req.env, **credentials.paths(job_directory, req.attempt)})
                try:
                    alloc = await self._launcher.start(req, adir, cwd, ident)
                except BaseException:
                    if cred is not None:
                        credentials.remove(credentials.job_dir(self.workdir_root, req.job_id), req.attempt)
                    raise
                self._book.allocs[alloc.key] = alloc
                self._book.prune()
            for w in alloc.workers:
                w.task = asyncio.create_task(self._book.supervise(alloc, w), name=f"worker-{req.job_id}-{w.spec.rank}")
            self._book.publish()
            log.info("workers started", extra={"pids": [w.record.pid for w in alloc.workers],
                                               "ranks": [w.spec.rank for w in alloc.workers], "cwd": cwd,
                                               "team": req.team, "run_as": str(ident) if ident else "agent"})
            return LaunchResult(pids=tuple(w.record.pid for w in alloc.workers), already_running=False)

    async def _write_credential(self, job_id: str, attempt: int, cred: credentials.Credential) -> None:
        async with self._credential_lock:
            await asyncio.to_thread(credentials.write, credentials.job_dir(self.workdir_root, job_id), attempt, cred)

    async def _replace_credential(self, alloc: Allocation, cred: credentials.Credential) -> None:
        await self._write_credential(alloc.job_id, alloc.attempt, cred)
        if not alloc.running:
            # The last worker ended while the files were written, and their removal came before the rename.
            credentials.remove(credentials.job_dir(self.workdir_root, alloc.job_id), alloc.attempt)

    async def renew_credential(self, job_id: str, attempt: int, leader_epoch: int,
                               cred: credentials.Credential) -> int:
        """Replace the credential files of the running workers of (job_id, attempt); returns how many run.
        InvalidArgument for a credential that is not one of that job and attempt, FailedPrecondition for a
        stale leader, another attempt or workers that have ended, NotFound for a job with no workers here."""
        check_job_id(job_id)
        if attempt < 0:
            raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
        grant = cred.check(job_id, attempt, self._clock.now())
        self.fence.check(leader_epoch)
        alloc = self._book.allocs.get((job_id, attempt))
        if alloc is None:
            here = sorted({a.attempt for a in self._book.allocs.values() if a.job_id == job_id})
            if not here:
                raise NotFound(f"job {job_id} has no workers on node {self._node_id}")
            raise FailedPrecondition(f"job {job_id} has attempt {', '.join(map(str, here))} on node "
                                     f"{self._node_id}, not attempt {attempt}")
        running = sum(1 for w in alloc.workers if w.running)
        if not running:
            raise FailedPrecondition(f"the workers of job {job_id} attempt {attempt} on node {self._node_id} have "
                                     "ended")
        await self._replace_credential(alloc, cred)
        log.info("checkpoint-store credential renewed", extra={"job_id": job_id, "attempt": attempt,
                                                               "team": grant.team, "workers": running})
        return running

    # --- exits ----------------------------------------------------------------------------------------------

    def mark_reported(self, exit: WorkerExit) -> None:
        """The scheduler acknowledged `exit`: remember it so no later life reports it again."""
        self._book.mark_reported(exit)

    # --- stop --------------------------------------------------------------------------------------------

    async def stop(self, job_id: str, attempt: int, grace_s: float | None = None,
                   first: signal.Signals = signal.SIGTERM) -> int:
        """Stop the workers of (job_id, attempt), or of every attempt when attempt is 0: `first` (SIGTERM,
        or the signal a job checkpoints on), then SIGKILL after the grace.

        Returns how many were running. Returns only when every process of their groups is gone (or
        `stopping.KILL_WAIT_S` after SIGKILL, for processes stuck in the kernel) and their exits are recorded.
        """
        check_job_id(job_id)
        if grace_s is not None and grace_s < 0:
            raise InvalidArgument(f"grace period must be >= 0, got {grace_s}")
        grace = self._stop_grace_s if grace_s is None else grace_s
        async with self._lock:
            allocs = [a for a in self._book.allocs.values()
                      if a.job_id == job_id and (attempt == 0 or a.attempt == attempt)]
        with log_context(job_id=job_id):
            counts = await asyncio.gather(*(stopping.stop_alloc(a, grace, first) for a in allocs))
        return sum(counts)

    # --- previous lives ------------------------------------------------------------------------------------

    async def recover(self) -> list[WorkerExit]:
        """Take over, or stop, the workers of an earlier agent life (see the module docstring).

        Returns the exits handed to the sink: recorded earlier but not acknowledged, then those of workers
        that ended while no agent watched, then (with `RestartPolicy.STOP`) those of the workers stopped now.
        Adopted workers still run when it returns; their exits come later.
        """
        return await recovery.recover(self._book, self.jobs_root, self._restart_policy, self._stop_grace_s)

    # --- queries -------------------------------------------------------------------------------------------

    def list_workers(self) -> list[WorkerStatus]:
        return self._book.list_workers()

    def running_allocations(self) -> list[RunningAllocation]:
        return self._book.running_allocations()

    def running_count(self) -> int:
        return self._book.running_count()

    def gpu_holders(self) -> dict[int, metrics.GpuHolder]:
        """The GPUs running workers hold, and whose they are (job and team)."""
        return self._book.gpu_holders()

    async def read_logs(self, query: LogQuery) -> list[LogLine]:
        # Reading tens of MiB must not stall the event loop (heartbeats, launches): a worker thread reads.
        return await asyncio.to_thread(logs.read_logs, self.jobs_root, query, max_bytes=MAX_LOG_ANSWER_BYTES)

    async def follow_logs(self, query: LogQuery) -> AsyncIterator[list[LogLine]]:
        """Retained lines, then new ones as they are written, until no matching worker runs here."""
        logs.require_job(self.jobs_root, query)
        follower = logs.LogFollower(self.jobs_root, query)
        try:
            while True:
                finished = not any(a.running for a in self._book.allocs.values() if a.job_id == query.job_id
                                   and (query.attempt == 0 or a.attempt == query.attempt))
                lines = await asyncio.to_thread(follower.poll)
                if lines:
                    yield lines
                elif finished:
                    # Read after the workers ended (their shims drained the output first): nothing is missed.
                    return
                if not follower.more:
                    # A worker's end wakes us at once; new lines are found by looking.
                    await self.changes.wait(timeout=FOLLOW_POLL_S)
        finally:
            follower.close()

    # --- shutdown ------------------------------------------------------------------------------------------

    async def close(self, *, kill: bool = False) -> None:
        """Stop supervising. With `kill`, stop every running worker first (exits are recorded and
        submitted, marked as ended by the agent's shutdown: the scheduler restarts their jobs as after a lost
        node); without, workers keep running under their shims and the next agent life takes them over (or
        stops them, per its restart policy)."""
        if kill:
            self._book.shutting_down = True
            allocs = list(self._book.allocs.values())
            await asyncio.gather(*(stopping.stop_alloc(a, self._stop_grace_s) for a in allocs))
        tasks = [w.task for a in self._book.allocs.values() for w in a.workers if w.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            await ended(task)


def _log_unheard(task: asyncio.Task[LaunchResult]) -> None:
    """The outcome of a launch whose caller went away: nobody else hears of it."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warning("a launch whose caller went away failed", extra={"error": str(exc)})
    else:
        log.info("a launch whose caller went away completed", extra={"pids": list(task.result().pids)})
