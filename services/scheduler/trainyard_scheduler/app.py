"""The scheduler process: gRPC servers on every replica; the reconcile loop only on the elected leader."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from collections.abc import Sequence

from trainyard.scheduler.v1 import (
    audit_pb2,
    audit_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    usage_pb2,
    usage_pb2_grpc,
)
from trainyard_core import contract
from trainyard_core.audit import AuditLog
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.rpc import liveness as liveness_options
from trainyard_core.rpc.admission import AdmissionInterceptor
from trainyard_core.rpc.audit import CallAudit
from trainyard_core.rpc.server import GrpcServer, start_grpc_server
from trainyard_core.service import start_or_undo
from trainyard_core.store.api import KeyValue, Store
from trainyard_core.store.election import LeaderElection
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_check import check_access
from trainyard_core.store.limits import txn_ops_limit
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.waits import completes_within, ended

from . import metrics, pulses
from .archive import Archiver, ArchiveSettings
from .audit_archive import AuditMover, AuditReader, MoveSettings
from .credential_renewal import CredentialRenewer, RenewalSettings, RenewPort
from .domain.models import Node
from .domain.pending import EMPTY as EMPTY_ORDER
from .domain.pending import PendingOrder
from .grpc.agent_client import GrpcAgents
from .grpc.audit_servicer import AuditServicer
from .grpc.job_watch_servicer import JobWatchServicer
from .grpc.policy_servicer import PolicyServicer
from .grpc.servicer import JobServicer, NodeServicer
from .grpc.usage_servicer import UsageServicer
from .history.access import History
from .leadership import Leadership
from .liveness import NodeLiveness
from .policy.registry import ProfileSpec, build_profile
from .pulses import PulseSessions
from .reconcile import AgentPort, Reconciler, ReconcileSettings
from .settings import SchedulerSettings
from .state.keys import Keys
from .state.mirrored_nodes import MirroredAllocations, MirroredNodes
from .state.policy_repository import PolicyRepository
from .state.repository import Repository, max_gang_nodes, placement_txn_ops
from .usage_report import UsageReader
from .worker_credentials import WorkerCredentials

log = logging.getLogger(__name__)
# Ports tried with listen_port 0 until one is free over UDP too (see `_start`).
PORT_TRIES = 5
# The call every agent makes at once when a new leader takes over: admitted a bounded number at a time.
REGISTER_NODE = "/" + scheduler_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name + "/RegisterNode"


class SchedulerApp:
    """`worker_credentials` and `renewal`: the attempts' checkpoint-store credentials and their renewal, from the
    settings by default (tests give a shorter lifetime than the settings allow)."""

    def __init__(self, settings: SchedulerSettings, *, store: Store | None = None, clock: Clock | None = None,
                 agents: AgentPort | None = None, worker_credentials: WorkerCredentials | None = None,
                 renewal: RenewalSettings | None = None) -> None:
        self.settings = settings
        self._own_store = store is None
        self.store: Store = store or EtcdStore.from_options(settings.etcd_options())
        # The election has its own client with calls bounded by half the lease TTL: a standby whose etcd
        # member hangs (no quorum, catching up) moves to the next member in time to take over within about
        # one TTL, instead of waiting out the main client's longer deadline.
        self._election_store: Store = store or EtcdStore.from_options(settings.etcd_options(),
                                                                      timeout=max(0.5, settings.leader_ttl_s / 2))
        self.clock = clock or SystemClock()
        self.keys = Keys(settings.etcd_prefix.rstrip("/"))
        # Every mutating call this replica serves, and its own launches and stops on agents.
        self.audit = AuditLog(self.store, settings.etcd_prefix, retention_s=settings.audit_retention_s(),
                              clock=self.clock)
        self._agents = agents or GrpcAgents(settings.tls, settings.agent_call_timeout_s, audit=self.audit)
        self._worker_credentials = worker_credentials or WorkerCredentials.from_settings(settings)
        self._renewal = renewal
        self.renewer: CredentialRenewer | None = None
        self.grpc_port = 0
        self._pulse_endpoint: pulses.PulseEndpoint | None = None
        self.leadership = Leadership("")
        self.liveness = NodeLiveness(self.clock, settings.node_timeout_s, grace_s=settings.leader_grace_s,
                                     stale_s=settings.stale_stream_s)
        self._election: LeaderElection | None = None
        self._mirror = PrefixMirror(self.store, self.keys.prefix + "/", include=self.keys.mirrored)
        self._server: GrpcServer | None = None
        self._stop = asyncio.Event()
        self._leader_task: asyncio.Task[None] | None = None
        self.reconciler: Reconciler | None = None
        self.archiver: Archiver | None = None
        self.audit_mover: AuditMover | None = None
        self.history = History(settings.history()) if settings.history() else None

    async def start(self) -> None:
        """Serve; a start that fails part way leaves nothing running."""
        await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        s = self.settings
        if isinstance(self.store, EtcdStore):
            await check_access(self.store, s.etcd_prefix)  # a wrong etcd credential stops the start here
        await self._mirror.start()
        if self.history is None:
            log.warning("history_url is not set: finished jobs stay in etcd for good (and in every replica's "
                        "memory). Set it to a PostgreSQL or SQLite URL (docs/operations.md, 'Job history')")
        largest_gang_ops = placement_txn_ops(contract.MAX_NODES)
        txn_ops = await txn_ops_limit(self.store, self.keys.leader, largest_gang_ops)
        if txn_ops < largest_gang_ops:
            log.warning("etcd takes at most %d operations per transaction, so gangs are limited to %d nodes (the "
                        "API allows %d); start etcd with --max-txn-ops %d to lift that", txn_ops,
                        max_gang_nodes(txn_ops), contract.MAX_NODES, largest_gang_ops)
        election_holder: list[LeaderElection] = []
        mirror = self._mirror

        async def from_mirror(key: str) -> KeyValue | None:
            return mirror.items.get(key)
        repo = Repository(self.store, self.keys, fence=lambda: election_holder[0].fence(),
                          holdings_source=from_mirror, node_source=from_mirror, max_txn_ops=txn_ops,
                          idempotency_ttl_s=s.idempotency_ttl_s)
        self.pulses = PulseSessions(self.liveness)
        mirrored_nodes = MirroredNodes(self._mirror, self.keys)

        async def fleet_view() -> Sequence[Node]:
            """The registered nodes from the mirror once it holds this replica's own writes (a cordon answered
            a moment ago shows); from etcd when the mirror lags more than a second."""
            if await mirror.wait_for(repo.written_revision, timeout=1.0):
                return await mirrored_nodes.nodes()
            return await repo.nodes.list()
        node_servicer = NodeServicer(repo, self.leadership, self.liveness, self.clock, s.heartbeat_interval_ms,
                                     worker_fence_s=s.worker_fence_s, pulses=self.pulses,
                                     registered=lambda node_id: self.keys.node(node_id) in self._mirror.items,
                                     fleet=fleet_view)
        job_servicer = JobServicer(repo, self.clock, self._mirror.changed, history=self.history,
                                   priority_classes=list(s.priority_classes), max_txn_ops=txn_ops,
                                   tool_teams=s.tool_team_map(), fleet=mirrored_nodes.nodes,
                                   leadership=self.leadership, pending=self._pending_order,
                                   audit=CallAudit(self.audit, "scheduler", authorized=s.tls is not None))
        policy_servicer = PolicyServicer(PolicyRepository(self.store, self.keys), wake=self._mirror.changed,
                                         holdings=MirroredAllocations(self._mirror, self.keys).current)
        usage_servicer = UsageServicer(UsageReader(self._mirror, self.keys, history=self.history, pricing=s.pricing(),
                                                   clock=self.clock), tool_teams=s.tool_team_map())
        audit_servicer = AuditServicer(AuditReader(self.audit, self.history))
        job_watch_servicer = JobWatchServicer(self._mirror, self.keys, self.history)

        def register(server: object) -> None:
            scheduler_pb2_grpc.add_JobServiceServicer_to_server(job_servicer, server)
            scheduler_pb2_grpc.add_NodeServiceServicer_to_server(node_servicer, server)
            policy_pb2_grpc.add_PolicyServiceServicer_to_server(policy_servicer, server)
            usage_pb2_grpc.add_UsageServiceServicer_to_server(usage_servicer, server)
            audit_pb2_grpc.add_AuditServiceServicer_to_server(audit_servicer, server)
            scheduler_pb2_grpc.add_JobWatchServiceServicer_to_server(job_watch_servicer, server)

        names = [scheduler_pb2.DESCRIPTOR.services_by_name[n].full_name
                 for n in ("JobService", "NodeService", "JobWatchService")]
        names.append(policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name)
        names.append(usage_pb2.DESCRIPTOR.services_by_name["UsageService"].full_name)
        names.append(audit_pb2.DESCRIPTOR.services_by_name["AuditService"].full_name)
        # Liveness pulses come to the gRPC port's number, over UDP (pulses.py). With listen_port 0 the gRPC
        # server takes any free TCP port, whose number may be taken over UDP (agents' pulses leave from
        # ephemeral UDP ports): then another port is taken. A configured port whose UDP twin is taken fails
        # the start, naming it. Either way no server is left listening behind a failed start.
        for tries_left in reversed(range(PORT_TRIES if s.listen_port == 0 else 1)):
            server = await start_grpc_server(host=s.listen_host, port=s.listen_port, register=register,
                                             service_names=names, tls=s.tls, audit=self.audit,
                                             audit_service="scheduler", options=liveness_options.SERVER_OPTIONS,
                                             admission=AdmissionInterceptor(
                                                 (REGISTER_NODE,), limit=s.register_concurrency,
                                                 max_wait_s=s.register_max_wait_s,
                                                 on_call=lambda _: self.liveness.knocking()))
            try:
                self._pulse_endpoint = await pulses.start_endpoint(s.listen_host, server.port, self.pulses)
            except OSError as exc:
                await server.stop(grace=0)
                if tries_left and isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EADDRINUSE:
                    log.info("UDP port %d is taken: listening on another port", server.port)
                    continue
                raise
            break
        self._server = server
        self.grpc_port = server.port
        host = s.listen_host if s.listen_host not in ("0.0.0.0", "::", "") else socket.getfqdn()
        identity = s.advertise_address or f"{host}:{self.grpc_port}"
        self.leadership.identity = identity
        election = LeaderElection(self._election_store, self.keys.leader, identity, s.leader_ttl_s)
        election_holder.append(election)
        self._election = election
        self._repo = repo
        self._txn_ops = txn_ops
        self._node_servicer = node_servicer
        self._leader_task = asyncio.create_task(self._lead(election, repo), name="leadership")
        log.info("scheduler serving", extra={"grpc_port": self.grpc_port, "identity": identity})

    def _pending_order(self) -> PendingOrder:
        return self.reconciler.pending if self.reconciler is not None else EMPTY_ORDER

    async def _lead(self, election: LeaderElection, repo: Repository) -> None:
        s = self.settings
        while not self._stop.is_set():
            # Who leads is kept fresh while campaigning (not read once before): a standby names the leader
            # to the callers it refuses, and they follow that name (the gateway's node calls).
            epoch = await election.campaign(self._stop, observe=self.leadership.observe)
            if not epoch:
                return
            self.liveness.reset()
            self.leadership.epoch = epoch  # the campaign has already observed this replica as the leader
            metrics.IS_LEADER.set(1)
            self.reconciler = Reconciler(
                repo=repo, mirror=self._mirror, liveness=self.liveness, agents=self._agents,
                profile=build_profile(ProfileSpec(order=s.placement_order)), clock=self.clock,
                epoch=lambda: election.epoch,
                settings=ReconcileSettings(interval_s=s.reconcile_interval_s, stop_grace_s=s.stop_grace_s,
                                           port_range=s.port_range, policy=s.policy(),
                                           checkpoint_store=s.checkpoint_store_address,
                                           max_infra_restarts=s.max_infra_restarts,
                                           worker_fence_s=s.worker_fence_s,
                                           pace_s_per_pending_job=s.reconcile_pace_us_per_pending_job / 1e6),
                worker_env=self._worker_credentials.env)
            stop_term = asyncio.Event()

            async def watch_loss(stop_term: asyncio.Event = stop_term) -> None:
                waits = {asyncio.ensure_future(election.lost.wait()), asyncio.ensure_future(self._stop.wait())}
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for p in pending:
                    p.cancel()
                # Refuse leader calls at once, not only once the reconciler's cycle has ended, and end the
                # agents' streams: their fence must run down from now, and they must look for the new leader.
                self.leadership.step_down()
                self._node_servicer.end_streams()
                stop_term.set()

            watcher = asyncio.create_task(watch_loss())
            ticker = asyncio.create_task(self.liveness.run_ticker(stop_term), name="liveness ticker")
            archiving: list[asyncio.Task[None]] = []
            if self.history is not None:
                self.archiver = Archiver(repo=repo, mirror=self._mirror, history=self.history, clock=self.clock,
                                         settings=ArchiveSettings(
                                             job_ttl_s=s.job_ttl_s,
                                             job_retention_s=s.history_job_retention_days * 86400.0,
                                             usage_retention_s=s.history_usage_retention_days * 86400.0),
                                         leading=functools.partial(_not_set, stop_term))
                archiving.append(asyncio.create_task(self.archiver.run(stop_term), name="archiver"))
                self.audit_mover = AuditMover(store=self.store, log_=self.audit, history=self.history,
                                              clock=self.clock, settings=MoveSettings(
                                                  retention_s=s.audit_retention_s(), txn_ops=self._txn_ops),
                                              leading=functools.partial(_not_set, stop_term))
                archiving.append(asyncio.create_task(self.audit_mover.run(stop_term), name="audit mover"))
            if self._worker_credentials.minting and isinstance(self._agents, RenewPort):
                # A running attempt's credential is renewed past half its lifetime (credential_renewal.py).
                self.renewer = CredentialRenewer(credentials=self._worker_credentials, mirror=self._mirror,
                                                 keys=self.keys, agents=self._agents, clock=self.clock,
                                                 epoch=lambda: election.epoch, settings=self._renewal,
                                                 leading=functools.partial(_not_set, stop_term))
                archiving.append(asyncio.create_task(self.renewer.run(stop_term), name="credential renewal"))
            await self.reconciler.run(stop_term)
            stop_term.set()
            for task in archiving:
                await task
            watcher.cancel()
            ticker.cancel()
            self.leadership.step_down()
            self._node_servicer.end_streams()
            metrics.IS_LEADER.set(0)
            # The backlogs are the leader's to measure: a former leader's last value would stand (and alert) for
            # ever beside the new leader's.
            metrics.HISTORY_BACKLOG.set(0)
            metrics.AUDIT_BACKLOG.set(0)
            log.warning("leadership ended", extra={"epoch": epoch})

    async def stop(self) -> None:
        self._stop.set()
        if self._leader_task is not None:
            # The term's own end, for a while; then it is cancelled. A cancel of this stop is not swallowed.
            if not await completes_within(asyncio.wait({self._leader_task}), 10):
                self._leader_task.cancel()
            await ended(self._leader_task)
        if self._election is not None:
            await self._election.resign()
        self.leadership.epoch = 0
        if self._server is not None:
            await self._server.stop(grace=2.0)
        if self._pulse_endpoint is not None:
            self._pulse_endpoint.close()
            self._pulse_endpoint = None
        await self._mirror.stop()
        if self.history is not None:
            await self.history.close()
        if isinstance(self._agents, GrpcAgents):
            await self._agents.close()
        if self._own_store:
            await self.store.close()
            await self._election_store.close()


def _not_set(event: asyncio.Event) -> bool:
    return not event.is_set()
