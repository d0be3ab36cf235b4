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
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from trainyard_core import telemetry
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.errors import FailedPrecondition, InvalidArgument, NotFound
from trainyard_core.logs import log_context

from .. import metrics
from ..model import Health, RunningAllocation, Vendor
from ..notify import Notifier
from ..tenancy import Identity, Tenancy, job_workdir, prepare_workdir_root
from . import affinity, credentials, lease, logs, logwriter, process, records, shim, spawn
from .env import worker_env
from .fence import LeaderFence
from .model import (
    EXIT_UNKNOWN,
    LaunchRequest,
    LaunchResult,
    LogLine,
    LogQuery,
    RestartPolicy,
    WorkerExit,
    WorkerSpec,
    WorkerStatus,
    check_job_id,
    exit_status,
)

log = logging.getLogger(__name__)
# A launch is a span of the job's trace (the scheduler's call carries its context); the workers' supervision
# tasks start inside it, so their log lines name the job's trace too.
_tracer = telemetry.tracer(__name__)

# After a worker exits, how long its shim may still drain its output before abandoning the pipes.
DRAIN_TIMEOUT_S = 5.0
# After SIGKILL, how long to wait for the kernel to take processes away (D state can delay it).
KILL_WAIT_S = 10.0
# Finished allocations kept in memory for ListWorkers; older ones live on in their record files.
KEEP_FINISHED = 256
# Largest GetWorkerLogs answer, well below the 64 MiB gRPC message limit.
MAX_LOG_ANSWER_BYTES = 32 * 1024 * 1024
# How often a log follower looks for new lines: the shims write the files and tell the agent nothing.
FOLLOW_POLL_S = 0.1


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
    # The shim this agent life started; None for a worker of a previous life (found by pid in the record).
    shim: asyncio.subprocess.Process | None = None
    exit: WorkerExit | None = None
    task: asyncio.Task[None] | None = None
    # The last signal a stop sent to the worker's group: what ended it, should its shim not say.
    stop_signal: int = 0

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
        # Set by close(kill=True): the exits recorded from then on are the agent's shutdown's doing.
        self._shutting_down = False
        self._gpu_cpus = affinity.check_gpu_cpus(gpu_cpus or {})
        self._cpu_binding = cpu_binding
        self._shim_python = shim_python
        self.jobs_root = state_dir / "jobs"
        self.jobs_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._tenancy = tenancy or Tenancy.single()
        self.workdir_root = workdir_root or state_dir / "work"
        prepare_workdir_root(self.workdir_root, shared=not self._tenancy.single_tenant)
        # The worker fence every shim watches (renewed by the agent's reporter; see lease.py).
        self.lease_path = state_dir / lease.LEASE_NAME
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
        # Credential files are written one at a time: an older credential never lands after a newer one.
        self._credential_lock = asyncio.Lock()
        # Reasons workers were not bound to CPUs, each logged once (every launch would repeat them).
        self._binding_warned: set[str] = set()
        # Wakes log followers and anyone waiting for workers to start or end.
        self.changes = Notifier()

    @property
    def restart_policy(self) -> RestartPolicy:
        return self._restart_policy

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
                existing = self._existing(req.job_id, req.attempt)
                if existing is not None:
                    log.info("launch retried; workers already started")
                    running = self._allocs.get((req.job_id, req.attempt))
                    if cred is not None and running is not None and running.running:
                        # A new leader's launch may carry a newer credential than the workers have.
                        await self._replace_credential(running, cred)
                    return LaunchResult(pids=existing, already_running=True)
                ident = self._tenancy.identity_for(req.team)
                self._check_gpus(req)
                cwd = self._working_dir(req, ident)
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
                    alloc = await self._spawn(req, adir, cwd, ident)
                except BaseException:
                    if cred is not None:
                        credentials.remove(credentials.job_dir(self.workdir_root, req.job_id), req.attempt)
                    raise
                self._allocs[alloc.key] = alloc
                self._prune()
            for w in alloc.workers:
                w.task = asyncio.create_task(self._supervise(alloc, w), name=f"worker-{req.job_id}-{w.spec.rank}")
            self._publish()
            log.info("workers started", extra={"pids": [w.record.pid for w in alloc.workers],
                                               "ranks": [w.spec.rank for w in alloc.workers], "cwd": cwd,
                                               "team": req.team, "run_as": str(ident) if ident else "agent"})
            return LaunchResult(pids=tuple(w.record.pid for w in alloc.workers), already_running=False)

    async def _write_credential(self, job_id: str, attempt: int, cred: credentials.Credential) -> None:
        async with self._credential_lock:
            await asyncio.to_thread(credentials.write, credentials.job_dir(self.workdir_root, job_id), attempt, cred)

    async def _replace_credential(self, alloc: _Allocation, cred: credentials.Credential) -> None:
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
        alloc = self._allocs.get((job_id, attempt))
        if alloc is None:
            here = sorted({a.attempt for a in self._allocs.values() if a.job_id == job_id})
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

    def _working_dir(self, req: LaunchRequest, ident: Identity | None) -> str:
        if req.working_dir:
            path = Path(req.working_dir)
            if not path.is_absolute():
                raise InvalidArgument(f"working_dir {req.working_dir!r} must be an absolute path")
            if not path.is_dir():
                raise InvalidArgument(f"working_dir {req.working_dir} does not exist on node {self._node_id}")
            return str(path)
        return str(job_workdir(self.workdir_root, req.job_id, ident))

    async def _spawn(self, req: LaunchRequest, adir: Path, cwd: str, ident: Identity | None) -> _Allocation:
        """Start every worker or none: a gang with a missing rank would hang in its first collective."""
        rec = records.AllocationRecord(job_id=req.job_id, attempt=req.attempt, node_id=self._node_id,
                                       created_at=self._clock.now(), team=req.team)
        alloc = _Allocation(job_id=req.job_id, attempt=req.attempt, dir=adir, record=rec)
        # The shims start at once: most of a launch is their interpreters starting.
        results = await asyncio.gather(*(self._start_worker(req, spec, adir, cwd, ident) for spec in req.workers),
                                       return_exceptions=True)
        started = [r for r in results if isinstance(r, spawn.Started)]
        failures = [r for r in results if isinstance(r, BaseException)]
        try:
            if failures:
                raise failures[0]
            for spec, st in zip(req.workers, started, strict=True):
                wrec = records.WorkerRecord(rank=spec.rank, local_rank=spec.local_rank,
                                            gpu_indices=list(spec.gpu_indices), pid=st.pid, pgid=st.pid,
                                            start_time=process.start_time(st.pid), shim_pid=st.shim.pid,
                                            shim_start_time=st.shim_start_time)
                rec.workers.append(wrec)
                alloc.workers.append(_Worker(spec=spec, record=wrec, shim=st.shim))
            # Before the shims commit and anyone is told the workers run: a later life finds them here.
            records.save(adir / records.RECORD_NAME, rec)
        except BaseException as exc:
            await self._release(started)
            if isinstance(exc, OSError):
                raise FailedPrecondition(f"node {self._node_id} cannot keep the workers' logs or records under "
                                         f"{adir}: {exc.strerror or exc}") from exc
            raise
        for st in started:
            spawn.commit(st)
        return alloc

    async def _start_worker(self, req: LaunchRequest, spec: WorkerSpec, adir: Path, cwd: str,
                            ident: Identity | None) -> spawn.Started:
        binding = self._binding(spec)
        env = worker_env(base=self._base_env, site_defaults=self._site_env, request_env=req.env, worker=spec,
                         vendor=self._vendor, node_id=self._node_id, home=cwd if ident else "")
        status = records.status_path(adir, spec.rank)
        # Left by a launch of this attempt that was never recorded; a later life must not read it as this
        # worker's end.
        status.unlink(missing_ok=True)
        return await spawn.start_worker(
            shim.Spec(command=list(req.command), env=env, cwd=cwd, cpus=sorted(binding.cpus),
                      log_path=str(logs.rank_log_path(adir, spec.rank)), max_bytes=self._log_max_bytes,
                      backups=self._log_backups, status_path=str(status), drain_timeout_s=DRAIN_TIMEOUT_S,
                      lease_path=str(self.lease_path), uid=ident.uid if ident else shim.SAME_USER,
                      gid=ident.gid if ident else shim.SAME_USER),
            err_path=records.shim_err_path(adir, spec.rank), python=self._shim_python)

    def _binding(self, spec: WorkerSpec) -> affinity.Binding:
        if not self._cpu_binding:
            return affinity.Binding(frozenset(), "CPU binding is switched off")
        binding = affinity.worker_binding(self._gpu_cpus, spec.gpu_indices, affinity.available_cpus())
        if binding.cpus:
            log.info("binding the worker to the CPUs of its GPUs",
                     extra={"rank": spec.rank, "cpus": affinity.format_cpus(binding.cpus)})
        elif self._gpu_cpus and spec.gpu_indices and binding.reason not in self._binding_warned:
            self._binding_warned.add(binding.reason)
            log.warning("workers are not bound to CPUs", extra={"reason": binding.reason})
        return binding

    async def _release(self, started: list[spawn.Started]) -> None:
        """Undo a failed launch: no worker of a gang that was never recorded may stay."""
        for st in started:
            process.signal_group(st.pid, signal.SIGKILL)
            spawn.release(st)
        for st in started:
            try:
                await asyncio.wait_for(process.wait_for_exit(st.shim), DRAIN_TIMEOUT_S + 1)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    st.shim.kill()

    # --- supervise ---------------------------------------------------------------------------------------

    async def _supervise(self, alloc: _Allocation, w: _Worker) -> None:
        with log_context(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank):
            if w.shim is not None:
                await process.wait_for_exit(w.shim)
            else:
                await process.wait_gone(w.record.shim_pid, w.record.shim_start_time)
            await self._settle(alloc, w)

    async def _settle(self, alloc: _Allocation, w: _Worker) -> None:
        """Record the end of `w`, whose shim has ended."""
        status = shim.read_status(records.status_path(alloc.dir, w.spec.rank))
        if status is not None:
            returncode, exited_at = status
            code, sig = exit_status(returncode)
        else:
            code, sig = await self._unknown_end(alloc, w)
            exited_at = self._clock.now()
        self._record_exit(alloc, w, code, sig, exited_at)

    async def _unknown_end(self, alloc: _Allocation, w: _Worker) -> tuple[int, int]:
        """(exit_code, signal) of a worker whose shim recorded no end: stop what is left of it (nobody reads
        its output any more), then report the signal of that stop, or EXIT_UNKNOWN."""
        if w.record.shim_pid is None:
            why = "it was started by an agent without shims, and its output went to that agent"
        else:
            why = "its shim ended without recording it" + _complaints(records.shim_err_path(alloc.dir, w.spec.rank))
        if _still_ours(w.record):
            log.warning("a worker runs on without its shim; stopping it", extra={"reason": why})
            await self._end_groups([w], self._stop_grace_s)
        if w.stop_signal:
            code, sig = 128 + w.stop_signal, w.stop_signal
        else:
            code, sig = EXIT_UNKNOWN, 0
        log.warning("the worker's exit status is unknown", extra={"reason": why, "exit_code": code, "signal": sig})
        self._note(alloc, w, f"[exit status unknown: {why}; reported as exit code {code}]")
        return code, sig

    def _note(self, alloc: _Allocation, w: _Worker, text: str) -> None:
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

    def _record_exit(self, alloc: _Allocation, w: _Worker, code: int, sig: int, exited_at: float) -> None:
        w.exit = WorkerExit(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank, exit_code=code,
                            signal=sig, exited_at=exited_at, agent_shutdown=self._shutting_down)
        w.record.exit_code, w.record.signal, w.record.exited_at = code, sig, exited_at
        w.record.agent_shutdown = self._shutting_down
        alloc.save()
        if not alloc.running:
            # Nothing here reads the attempt's credential any more (a restarted attempt gets its own).
            credentials.remove(credentials.job_dir(self.workdir_root, alloc.job_id), alloc.attempt)
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

    async def stop(self, job_id: str, attempt: int, grace_s: float | None = None,
                   first: signal.Signals = signal.SIGTERM) -> int:
        """Stop the workers of (job_id, attempt), or of every attempt when attempt is 0: `first` (SIGTERM,
        or the signal a job checkpoints on), then SIGKILL after the grace.

        Returns how many were running. Returns only when every process of their groups is gone (or
        KILL_WAIT_S after SIGKILL, for processes stuck in the kernel) and their exits are recorded.
        """
        check_job_id(job_id)
        if grace_s is not None and grace_s < 0:
            raise InvalidArgument(f"grace period must be >= 0, got {grace_s}")
        grace = self._stop_grace_s if grace_s is None else grace_s
        async with self._lock:
            allocs = [a for a in self._allocs.values()
                      if a.job_id == job_id and (attempt == 0 or a.attempt == attempt)]
        with log_context(job_id=job_id):
            counts = await asyncio.gather(*(self._stop_alloc(a, grace, first) for a in allocs))
        return sum(counts)

    async def _stop_alloc(self, alloc: _Allocation, grace: float, first: signal.Signals = signal.SIGTERM) -> int:
        if alloc.stop_task is not None and not alloc.stop_task.done():
            await asyncio.shield(alloc.stop_task)
            return 0
        running = [w for w in alloc.workers if w.running]
        if not running:
            return 0
        log.info("stopping workers", extra={"attempt": alloc.attempt, "ranks": [w.spec.rank for w in running],
                                            "grace_s": grace})
        alloc.stop_task = asyncio.create_task(self._terminate(running, grace, first))
        await asyncio.shield(alloc.stop_task)
        return len(running)

    async def _terminate(self, workers: list[_Worker], grace: float, first: signal.Signals = signal.SIGTERM) -> None:
        await self._end_groups(workers, grace, first)
        # The supervise tasks record the exits once the shims have drained the output and ended; wait for
        # them so the caller sees the exits recorded.
        tasks = {w.task: w for w in workers if w.task is not None}
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S + 1)
        if pending:
            # Their workers are gone, yet the shims do not end (stuck writing the log?): end them.
            log.error("worker shims do not end after their workers; killing them",
                      extra={"ranks": [tasks[t].spec.rank for t in pending]})
            for task in pending:
                rec = tasks[task].record
                process.kill_process(rec.shim_pid, rec.shim_start_time, signal.SIGKILL)
            await asyncio.wait(pending, timeout=KILL_WAIT_S)

    async def _end_groups(self, workers: list[_Worker], grace: float,
                          first: signal.Signals = signal.SIGTERM) -> None:
        """Send `first` (SIGTERM by default) to the workers' process groups, SIGKILL those still there after
        `grace`; returns when they are gone, or KILL_WAIT_S after SIGKILL for processes stuck in the kernel."""
        by_pgid = {w.record.pgid: w for w in workers}
        for pgid, w in by_pgid.items():
            w.stop_signal = first
            process.signal_group(pgid, first)
        left = await process.wait_groups_gone(by_pgid, grace)
        if left:
            log.warning("workers ignored %s for the grace period; killing", first.name,
                        extra={"pgids": sorted(left)})
            for pgid in left:
                by_pgid[pgid].stop_signal = signal.SIGKILL
                process.signal_group(pgid, signal.SIGKILL)
            stuck = await process.wait_groups_gone(left, KILL_WAIT_S)
            if stuck:
                log.error("processes survive SIGKILL (stuck in the kernel?)", extra={"pgids": sorted(stuck)})

    # --- previous lives ------------------------------------------------------------------------------------

    async def recover(self) -> list[WorkerExit]:
        """Take over, or stop, the workers of an earlier agent life (see the module docstring).

        Returns the exits handed to the sink: recorded earlier but not acknowledged, then those of workers
        that ended while no agent watched, then (with `RestartPolicy.STOP`) those of the workers stopped now.
        Adopted workers still run when it returns; their exits come later.
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
                                        wr.exited_at or 0.0, agent_shutdown=wr.agent_shutdown)
                alloc.workers.append(w)
            found.append(alloc)
            self._allocs[alloc.key] = alloc
        submitted = [w.exit for a in found for w in a.workers if w.exit is not None and not w.record.reported]
        for exit in submitted:
            self.exits.submit(exit)
        pending = [(a, w) for a in found for w in a.workers if w.running]
        live = [(a, w) for a, w in pending if process.is_running(w.record.shim_pid, w.record.shim_start_time)]
        live_ids = {id(w) for _, w in live}
        # Ended while no agent watched (or their shim did): settled now, before anything is served.
        await asyncio.gather(*(self._settle_previous(a, w) for a, w in pending if id(w) not in live_ids))
        for a, w in live:
            w.task = asyncio.create_task(self._supervise(a, w), name=f"worker-{a.job_id}-{w.spec.rank}")
        adopted = list({id(a): a for a, _ in live}.values())
        for a in adopted:
            with log_context(job_id=a.job_id, attempt=a.attempt):
                ranks = [w.spec.rank for b, w in live if b is a]
                if self._restart_policy is RestartPolicy.STOP:
                    log.warning("workers of a previous agent life are still running; stopping them (restart "
                                "policy stop)", extra={"ranks": ranks})
                else:
                    log.info("workers of a previous agent life are still running; adopted them",
                             extra={"ranks": ranks, "pids": [w.record.pid for b, w in live if b is a]})
        if self._restart_policy is RestartPolicy.STOP:
            await asyncio.gather(*(self._stop_alloc(a, self._stop_grace_s) for a in adopted))
        submitted += [w.exit for _, w in pending if w.exit is not None]
        self._prune()
        self._publish()
        return submitted

    async def _settle_previous(self, alloc: _Allocation, w: _Worker) -> None:
        with log_context(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank):
            await self._settle(alloc, w)
            log.info("worker of a previous agent life ended", extra={"exit_code": w.record.exit_code,
                                                                      "signal": w.record.signal})

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

    def gpu_holders(self) -> dict[int, metrics.GpuHolder]:
        """The GPUs running workers hold, and whose they are (job and team)."""
        return {gpu: metrics.GpuHolder(a.job_id, a.record.team) for a in self._allocs.values() for w in a.workers
                if w.running for gpu in w.spec.gpu_indices}

    async def read_logs(self, query: LogQuery) -> list[LogLine]:
        # Reading tens of MiB must not stall the event loop (heartbeats, launches): a worker thread reads.
        return await asyncio.to_thread(logs.read_logs, self.jobs_root, query, max_bytes=MAX_LOG_ANSWER_BYTES)

    async def follow_logs(self, query: LogQuery) -> AsyncIterator[list[LogLine]]:
        """Retained lines, then new ones as they are written, until no matching worker runs here."""
        logs.require_job(self.jobs_root, query)
        follower = logs.LogFollower(self.jobs_root, query)
        try:
            while True:
                finished = not any(a.running for a in self._allocs.values() if a.job_id == query.job_id
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
            self._shutting_down = True
            await asyncio.gather(*(self._stop_alloc(a, self._stop_grace_s) for a in list(self._allocs.values())))
        tasks = [w.task for a in self._allocs.values() for w in a.workers if w.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _publish(self) -> None:
        metrics.WORKERS_RUNNING.labels(self._node_id).set(self.running_count())
        metrics.set_gpu_holders(self._node_id, self.gpu_holders())
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


def _log_unheard(task: asyncio.Task[LaunchResult]) -> None:
    """The outcome of a launch whose caller went away: nobody else hears of it."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warning("a launch whose caller went away failed", extra={"error": str(exc)})
    else:
        log.info("a launch whose caller went away completed", extra={"pids": list(task.result().pids)})


def _complaints(err_path: Path) -> str:
    """The end of what a shim wrote to its stderr file, for the log."""
    try:
        text = err_path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return f" (it said: {text[-300:]})" if text else ""
