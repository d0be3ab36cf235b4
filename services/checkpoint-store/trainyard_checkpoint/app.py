"""The checkpoint-store assembled: store, storage, manager, leases, GC loop and gRPC server, started and
stopped in order.

Used by main.py (the process) and by tests (in-process on port 0).
"""

from __future__ import annotations

import asyncio
import logging

import grpc.aio

from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_core.audit import AuditLog
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.rpc.server import GrpcServer, start_grpc_server
from trainyard_core.store import Store
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_check import check_access
from trainyard_core.waits import cancel_and_wait

from .access import CheckpointAccess
from .domain.gc import GcTiming
from .gc import GarbageCollector
from .grpc.servicer import SERVICE_NAME, CheckpointServicer
from .leases import RestoreLeases
from .manager import CheckpointManager
from .repository import CheckpointRepository
from .settings import CheckpointSettings
from .storage import CheckpointStorage, open_storage
from .verify import ShardVerifier

log = logging.getLogger(__name__)


class CheckpointApp:
    """`store`: the metadata store to use; None opens an etcd client from the settings (and closes it on
    stop). A store passed in belongs to the caller and is left open."""

    def __init__(self, settings: CheckpointSettings, store: Store | None = None,
                 clock: Clock | None = None) -> None:
        self.settings = settings
        self._given_store = store
        self._clock = clock or SystemClock()
        self._store: Store | None = None
        self._storage: CheckpointStorage | None = None
        self._server: GrpcServer | None = None
        self._manager: CheckpointManager | None = None
        self._gc_stop = asyncio.Event()
        self._gc_task: asyncio.Task[None] | None = None
        self.gc: GarbageCollector | None = None
        self.grpc_port = 0

    async def start(self) -> None:
        """Check the storage, connect the store lazily, serve, start the GC loop. Raises OSError when the
        storage or the listen address cannot be used (the process then exits with a clear message)."""
        s = self.settings
        storage = open_storage(s)
        self._storage = storage
        try:
            await storage.check()
        except BaseException:
            await self._close_storage()
            raise
        store: Store = self._given_store if self._given_store is not None else EtcdStore.from_options(s.etcd_options())
        self._store = store
        if isinstance(store, EtcdStore) and self._given_store is None:
            try:
                await check_access(store, s.etcd_prefix)  # a wrong etcd credential stops the start here
            except BaseException:
                await self._close_store()
                raise
        repo = CheckpointRepository(store, s.etcd_prefix)
        verifier = ShardVerifier(storage, mode=s.commit_verify, concurrency=s.verify_concurrency)
        manager = CheckpointManager(repo, storage, self._clock, verifier=verifier)
        self._manager = manager
        leases = RestoreLeases(repo, self._clock, max_ttl_s=s.restore_lease_max_ttl_s)
        timing = GcTiming(grace_s=s.gc_grace_s, abandon_writing_s=s.gc_abandon_writing_s,
                          tombstone_retention_s=s.gc_tombstone_retention_s)
        self.gc = GarbageCollector(manager, self._clock, timing, lock_ttl_s=s.gc_lock_ttl_s)
        servicer = CheckpointServicer(manager, leases, self.gc)

        def register(server: grpc.aio.Server) -> None:
            pb_grpc.add_CheckpointServiceServicer_to_server(servicer, server)

        try:
            audit = AuditLog(store, s.etcd_prefix, retention_s=s.audit_retention_s(), clock=self._clock)
            self._server = await start_grpc_server(host=s.listen_host, port=s.listen_port, register=register,
                                                   service_names=[SERVICE_NAME], tls=s.tls,
                                                   job_binding=CheckpointAccess(repo, s.tool_team_map()), audit=audit,
                                                   audit_service="checkpoint-store")
        except BaseException:
            await self._close_store()
            raise
        self.grpc_port = self._server.port
        if s.gc_interval_s > 0:
            self._gc_task = asyncio.create_task(self.gc.run_forever(s.gc_interval_s, self._gc_stop),
                                                name="checkpoint gc")
        log.info("checkpoint-store serving", extra={
            "grpc_address": f"{s.listen_host}:{self.grpc_port}", "storage_url": storage.url,
            "commit_verify": s.commit_verify, "gc_interval_s": s.gc_interval_s})

    async def _close_storage(self) -> None:
        storage, self._storage = self._storage, None
        if storage is not None:
            await storage.close()

    async def _close_store(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()
        store, self._store = self._store, None
        try:
            if store is not None and self._given_store is None:
                await store.close()
        finally:
            await self._close_storage()

    async def stop(self) -> None:
        """Stop the GC loop and serving (in-flight calls get `shutdown_grace_s`), then close the store and
        the storage. Idempotent."""
        self._gc_stop.set()
        task, self._gc_task = self._gc_task, None
        if task is not None:
            try:
                await asyncio.wait_for(task, self.settings.shutdown_grace_s + 1)
            except TimeoutError:
                await cancel_and_wait(task)
        server, self._server = self._server, None
        try:
            if server is not None:
                await server.stop(self.settings.shutdown_grace_s)
        finally:
            await self._close_store()
