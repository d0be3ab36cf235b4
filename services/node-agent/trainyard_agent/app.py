"""The node agent assembled: NVML (real or simulated), health, worker supervision, the gRPC server and the
scheduler reporter. main.py builds one from settings; tests build one with a fake NVML and a tmp state dir.

Start-up order matters: GPUs are read first (a host without NVML fails here, before anything listens);
workers of a previous life are dealt with before the server accepts new launches; the scheduler hears
of this node only once its gRPC server is reachable at the address it registers.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import grpc.aio

from trainyard.agent.v1 import agent_pb2_grpc
from trainyard_core.audit import AuditFile
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.logs import log_context
from trainyard_core.rpc import liveness
from trainyard_core.rpc.server import CHANNEL_OPTIONS, GrpcServer, start_grpc_server
from trainyard_core.security import identity
from trainyard_core.security.tls import ClientTls, target_name_option
from trainyard_core.service import start_or_undo

from .gpu_history import GpuHistory
from .grpc.servicer import SERVICE_NAME, AgentServicer
from .health.book import HealthBook, read_boot_id
from .health.faults import FaultInjector
from .health.monitor import GpuMonitor
from .health.operator import AUDIT_FILE, AuditLog, HealthOverrides
from .health.policy import HealthPolicy, load_policy
from .metrics import metrics_hostname
from .model import Health, HealthCounters, Inventory, NodeInfo, Vendor
from .nvml.adapter import NvmlAdapter, NvmlModule
from .nvml.fake import FakeNvml
from .report import Backoff, ChannelFactory, ExitReporter, Link, NodeView, Reporter
from .settings import AgentSettings, state_path
from .tenancy import Tenancy
from .workers.fence import LeaderFence
from .workers.supervisor import Supervisor

log = logging.getLogger(__name__)

# How long a shutdown that kills workers waits for their exits to reach the scheduler.
EXIT_FLUSH_S = 3.0
# GPU findings that must survive an agent restart (XIDs, operator overrides), in the state dir.
HEALTH_FILE = "gpu-health.json"
# The audit log of calls this agent served (the cluster's own log, in etcd, is the scheduler's and gateway's).
AUDIT_LOG_FILE = "audit.jsonl"
# grpc's own reconnect backoff grows to 2 minutes by default; a restarted scheduler must be found sooner.
# (Not grpc.min_reconnect_backoff_ms: gRPC takes it as the shortest connect timeout too, and 200 ms cut off
# every TLS handshake over a link with a few hundred ms of latency; RegisterNode's deadline bounds a connect.)
# Keepalive (slow: liveness.AGENT_KEEPALIVE_S) only clears connections that died without a FIN; the agent notices
# a silent leader by its unacknowledged pulses (pulse.py), which also bound how long its worker fence is renewed.
_SCHEDULER_CHANNEL_OPTIONS = liveness.merged(CHANNEL_OPTIONS, [
    *liveness.CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)])


def scheduler_channel(address: str, tls: ClientTls | None = None) -> ChannelFactory:
    """Channels to the scheduler replicas in `address` (comma-separated), a different one per call: a
    session that failed (a replica down, or one that is not the leader) reconnects to the next replica.

    With `tls` each channel presents this node's certificate and accepts only a server whose certificate
    names the scheduler: the leader epochs its answers carry raise this agent's fence, so they must come
    from the scheduler and nobody else. Credentials are taken at each new channel, so a rotated certificate
    is used from the next session on."""
    targets = itertools.cycle([t.strip() for t in address.split(",") if t.strip()])
    options = [*_SCHEDULER_CHANNEL_OPTIONS, target_name_option(identity.SCHEDULER)]

    def open_channel(target: str) -> grpc.aio.Channel:
        if tls is None:
            return grpc.aio.insecure_channel(target, options=_SCHEDULER_CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(target, tls.credentials(), options=options)

    def connect() -> Link:
        target = next(targets)
        return Link(open_channel(target), target, reopen=functools.partial(open_channel, target))
    return connect


def _host_memory_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


def _host_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


class AgentApp:
    """One node agent. `start()` then `stop()`; attributes below are set by `start()`.

    `nvml_module`: a pynvml-compatible module (tests pass `FakeNvml`); by default the real pynvml, or a
    `FakeNvml` of `settings.gpu_profile` when one is set. `connect`: how to reach the scheduler (default:
    a channel to `settings.scheduler_address`, mTLS when the settings name certificate files). `base_env`:
    the environment workers inherit (default: the agent's own).
    """

    def __init__(self, settings: AgentSettings, nvml_module: NvmlModule | None = None, *,
                 connect: ChannelFactory | None = None, base_env: Mapping[str, str] | None = None,
                 clock: Clock | None = None) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self._nvml_module = nvml_module
        # One certificate source for both: a rotation is seen by whichever opens its next channel first.
        tls = ClientTls(settings.tls) if settings.tls is not None and connect is None else None
        self._connect = connect or scheduler_channel(settings.scheduler_address, tls)
        # The exit reporter rotates through the replicas on its own, independent of the heartbeat session.
        self._connect_exits = connect or scheduler_channel(settings.scheduler_address, tls)
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._clock = clock or SystemClock()
        self.grpc_port = 0
        self.simulated = False
        self.fake: FakeNvml | None = None
        self.inventory: Inventory | None = None
        self.adapter: NvmlAdapter | None = None
        self.policy: HealthPolicy | None = None
        self.health: HealthBook | None = None
        self.monitor: GpuMonitor | None = None
        self.history: GpuHistory | None = None
        self.overrides: HealthOverrides | None = None
        self.fence = LeaderFence()
        self.supervisor: Supervisor | None = None
        self.exit_reporter: ExitReporter | None = None
        self.reporter: Reporter | None = None
        self.server: GrpcServer | None = None

    async def start(self) -> None:
        with log_context(node_id=self.node_id):
            await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        s = self.settings
        # First: an agent that cannot keep teams apart as configured starts nothing (TenancyError).
        tenancy = Tenancy.decide(s.run_as, single_tenant=s.single_tenant, euid=os.geteuid())
        if tenancy.single_tenant:
            log.warning("single_tenant: every worker runs as the agent's own user, where jobs of different teams "
                        "can read each other's files, logs and environment", extra={"uid": os.geteuid()})
        else:
            log.info("workers run as their team's Unix identity",
                     extra={"run_as": {team: str(i) for team, i in tenancy.identities.items()}})
        self.policy = load_policy(s.health_policy_file)  # checked with the settings already
        state_dir = state_path(s)
        module = self._open_nvml()
        assert self.adapter is not None
        self.adapter.open()  # raises NvmlUnavailable with what to do about it
        # Topology reads every GPU pair through the driver: seconds on a big host, so off the event loop.
        self.inventory = await asyncio.to_thread(self.adapter.inventory)
        self.health = HealthBook(self.inventory.accelerators, store=state_dir / HEALTH_FILE, boot_id=read_boot_id())
        self.history = GpuHistory(self._clock, interval_s=s.heartbeat_interval_s)
        self.monitor = GpuMonitor(self.adapter, self.health, self.policy, node_id=self.node_id,
                                  interval_s=s.heartbeat_interval_s, counters_interval_s=s.health_counters_interval_s,
                                  history=self.history,
                                  hostname=metrics_hostname(self.node_id, simulated=self.simulated))
        if len(self.health):
            await self.monitor.poll_once()  # GPUs already lost are known before the first registration
        self.overrides = HealthOverrides(self.health, AuditLog(state_dir / AUDIT_FILE), node_id=self.node_id,
                                         counters=self._counters, clock=self._clock)
        islands = sorted({g.nvlink_island for g in self.inventory.accelerators if g.nvlink_island >= 0})
        log.info("GPUs found", extra={"simulated": self.simulated, "vendor": self.inventory.vendor.value,
                                      "gpus": len(self.health), "driver": self.inventory.driver_version,
                                      "cuda": self.inventory.runtime_version, "nvlink_islands": len(islands),
                                      "nvml": getattr(module, "__name__", type(module).__name__)})

        self.exit_reporter = ExitReporter(node_id=self.node_id, connect=self._connect_exits, backoff=self._backoff())
        self.supervisor = Supervisor(
            state_dir=state_dir, node_id=self.node_id, vendor=self.inventory.vendor,
            gpu_health=self._gpu_health, base_env=self._base_env, site_env=s.worker_env,
            stop_grace_s=s.stop_grace_s, log_max_bytes=s.log_max_bytes, log_backups=s.log_backups,
            fence=self.fence, exits=self.exit_reporter, clock=self._clock,
            restart_policy=s.worker_restart_policy, cpu_binding=s.worker_cpu_binding,
            tenancy=tenancy, workdir_root=Path(s.workdir_root),
            # NUMA-aware binding: each GPU's CPUs as the topology reports them.
            gpu_cpus={g.index: g.cpu_affinity for g in self.inventory.accelerators if g.cpu_affinity})
        self.exit_reporter.on_done = self.supervisor.mark_reported
        await self.supervisor.recover()

        servicer = AgentServicer(self.supervisor, FaultInjector(self.fake, self.health, self.monitor), self.overrides,
                                 self.history)
        # No etcd here: the agent's side of each mutating call goes to a local file (docs/security.md).
        self.audit = AuditFile(state_dir / AUDIT_LOG_FILE, max_bytes=s.audit_max_bytes, backups=s.audit_backups,
                               clock=self._clock)
        self.server = await start_grpc_server(
            host=s.listen_host, port=s.listen_port, service_names=[SERVICE_NAME], tls=s.tls,
            audit=self.audit, audit_service=f"agent/{self.node_id}",
            register=lambda server: agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server))
        self.grpc_port = self.server.port
        log.info("agent listening", extra={"address": s.agent_address(self.grpc_port)})

        self.reporter = Reporter(
            node_id=self.node_id, connect=self._connect, fence=self.fence, interval_s=s.heartbeat_interval_s,
            backoff=self._backoff(), clock=self._clock, lease_path=self.supervisor.lease_path,
            view=NodeView(node_info=self.node_info, running=self.supervisor.running_allocations,
                          health=self.health, changes=self.supervisor.changes))
        self.monitor.start()
        self.exit_reporter.start()
        self.reporter.start()

    def _open_nvml(self) -> NvmlModule:
        module: NvmlModule
        if self._nvml_module is not None:
            module = self._nvml_module
        elif self.settings.gpu_profile:
            module = FakeNvml(self.settings.gpu_profile, seed=self.node_id)
        else:
            import pynvml

            module = pynvml
        self.fake = module if isinstance(module, FakeNvml) else None
        self.simulated = self.fake is not None
        vendor = self.fake.vendor if self.fake is not None else Vendor.NVIDIA
        self.adapter = NvmlAdapter(module, vendor)
        return module

    def _counters(self, index: int) -> HealthCounters | None:
        return self.monitor.counters.get(index) if self.monitor is not None else None

    def _backoff(self) -> Backoff:
        return Backoff(self.settings.reconnect_initial_s, self.settings.reconnect_max_s)

    def _gpu_health(self) -> list[tuple[Health, str]]:
        assert self.health is not None
        return [(g.health, g.health_reason) for g in self.health.all()]

    def node_info(self) -> NodeInfo:
        assert self.health is not None and self.inventory is not None
        return NodeInfo(
            node_id=self.node_id, hostname=socket.gethostname(),
            agent_address=self.settings.agent_address(self.grpc_port),
            worker_address=self.settings.worker_address, accelerators=self.health.all(), cpus=_host_cpus(),
            memory_mb=_host_memory_mb(), driver_version=self.inventory.driver_version, simulated=self.simulated,
            labels=dict(self.settings.labels), cuda_version=self.inventory.runtime_version,
            gpu_links=self.inventory.links)

    async def stop(self, kill_workers: bool = False) -> None:
        """Stop serving and reporting. Workers keep running unless `kill_workers` (an agent restart must not
        kill jobs; the local cluster and tests shut their workers down with it)."""
        with log_context(node_id=self.node_id):
            if self.server is not None:
                # No new launches from here on; calls in flight get a second to finish.
                await self.server.stop(grace=1.0)
                self.server = None
            if self.supervisor is not None:
                await self.supervisor.close(kill=kill_workers)
                reporter = self.exit_reporter
                if kill_workers and reporter is not None and not await reporter.flush(EXIT_FLUSH_S):
                    log.warning("some worker exits were not acknowledged before shutdown; the next agent "
                                "start reports them", extra={"pending": len(reporter.pending)})
            for part in (self.reporter, self.exit_reporter, self.monitor):
                if part is not None:
                    await part.stop()
            if self.adapter is not None:
                self.adapter.close()
                self.adapter = None
