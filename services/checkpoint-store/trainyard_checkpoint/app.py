"""The checkpoint-store assembled: store, storage, manager and gRPC server, started and stopped in order.

Used by main.py (the process) and by tests (in-process on port 0).
"""

from __future__ import annotations

import logging

import grpc.aio

from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.rpc.server import GrpcServer, start_grpc_server
from trainyard_core.store import Store
from trainyard_core.store.etcd import EtcdStore

from .grpc.servicer import SERVICE_NAME, CheckpointServicer
from .manager import CheckpointManager
from .repository import CheckpointRepository
from .settings import CheckpointSettings
from .storage import PosixStorage

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
        self._server: GrpcServer | None = None
        self.grpc_port = 0

    async def start(self) -> None:
        """Check the storage root, connect the store lazily, serve. Raises OSError when the storage root
        or the listen address cannot be used (the process then exits with a clear message)."""
        storage = PosixStorage(self.settings.storage_root)
        storage.ensure_root()
        store: Store = self._given_store if self._given_store is not None else \
            EtcdStore(self.settings.etcd_endpoints)
        self._store = store
        repo = CheckpointRepository(store, self.settings.etcd_prefix)
        servicer = CheckpointServicer(CheckpointManager(repo, storage, self._clock))

        def register(server: grpc.aio.Server) -> None:
            pb_grpc.add_CheckpointServiceServicer_to_server(servicer, server)

        try:
            self._server = await start_grpc_server(host=self.settings.listen_host,
                                                   port=self.settings.listen_port, register=register,
                                                   service_names=[SERVICE_NAME])
        except BaseException:
            await self._close_store()
            raise
        self.grpc_port = self._server.port
        log.info("checkpoint-store serving", extra={
            "grpc_address": f"{self.settings.listen_host}:{self.grpc_port}", "storage_url": storage.url})

    async def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is not None and self._given_store is None:
            await store.close()

    async def stop(self) -> None:
        """Stop serving (in-flight calls get `shutdown_grace_s`), then close the store. Idempotent."""
        server, self._server = self._server, None
        try:
            if server is not None:
                await server.stop(self.settings.shutdown_grace_s)
        finally:
            await self._close_store()
