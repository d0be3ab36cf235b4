"""Launch preparation: check a launch against this node (its GPUs, the working directory), then start
the gang's shims, every worker or none, each bound to the CPUs of its GPUs and given its environment.

Separate from `supervisor.py`, which decides whether a launch happens (fence, idempotency, tenancy,
credentials) and supervises what it started: this is how a launch is carried out, and holds the settings
only that needs (environment, CPU binding, shim interpreter, log rotation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from trainyard_core.clock import Clock
from trainyard_core.errors import FailedPrecondition, InvalidArgument

from ..model import Health, Vendor
from ..tenancy import Identity, job_workdir
from . import affinity, logs, process, records, shim, spawn
from .allocation import Allocation, Worker
from .env import worker_env
from .model import LaunchRequest, WorkerSpec
from .stopping import DRAIN_TIMEOUT_S

log = logging.getLogger(__name__)


class Launcher:
    """Starts the workers of a launch on this node (see `Supervisor` for the settings)."""

    def __init__(
        self,
        *,
        node_id: str,
        vendor: Vendor,
        gpu_health: Callable[[], list[tuple[Health, str]]],
        base_env: Mapping[str, str],
        site_env: Mapping[str, str],
        log_max_bytes: int,
        log_backups: int,
        gpu_cpus: Mapping[int, frozenset[int]],
        cpu_binding: bool,
        shim_python: str,
        workdir_root: Path,
        lease_path: Path,
        clock: Clock,
    ) -> None:
        self._node_id = node_id
        self._vendor = vendor
        self._gpu_health = gpu_health
        self._base_env = dict(base_env)
        self._site_env = dict(site_env)
        self._log_max_bytes = log_max_bytes
        self._log_backups = log_backups
        self._gpu_cpus = gpu_cpus
        self._cpu_binding = cpu_binding
        self._shim_python = shim_python
        self._workdir_root = workdir_root
        self._lease_path = lease_path
        self._clock = clock
        # Reasons workers were not bound to CPUs, each logged once (every launch would repeat them).
        self._binding_warned: set[str] = set()

    def check_gpus(self, req: LaunchRequest, allocs: Iterable[Allocation]) -> None:
        health = self._gpu_health()
        busy = {gpu: alloc.key for alloc in allocs for w in alloc.workers if w.running
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

    def working_dir(self, req: LaunchRequest, ident: Identity | None) -> str:
        if req.working_dir:
            path = Path(req.working_dir)
            if not path.is_absolute():
                raise InvalidArgument(f"working_dir {req.working_dir!r} must be an absolute path")
            if not path.is_dir():
                raise InvalidArgument(f"working_dir {req.working_dir} does not exist on node {self._node_id}")
            return str(path)
        return str(job_workdir(self._workdir_root, req.job_id, ident))

    async def start(self, req: LaunchRequest, adir: Path, cwd: str, ident: Identity | None) -> Allocation:
        """Start every worker or none: a gang with a missing rank would hang in its first collective."""
        rec = records.AllocationRecord(job_id=req.job_id, attempt=req.attempt, node_id=self._node_id,
                                       created_at=self._clock.now(), team=req.team)
        alloc = Allocation(job_id=req.job_id, attempt=req.attempt, dir=adir, record=rec)
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
                alloc.workers.append(Worker(spec=spec, record=wrec, shim=st.shim))
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
                      lease_path=str(self._lease_path), uid=ident.uid if ident else shim.SAME_USER,
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
