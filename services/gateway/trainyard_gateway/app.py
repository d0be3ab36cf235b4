"""The gateway process: the FastAPI application (`create_app`) and its lifecycle (`GatewayApp`).

`GatewayApp.start()` opens the etcd store, stores the bootstrap operator token (hashed) when one is
configured (the local cluster's), opens the channel pool to the scheduler, the agents and (with
checkpoint_store_address) the checkpoint-store, starts the read view's feed (job_view.py; unless the job_view
setting is off), then serves HTTP
with uvicorn inside the running event loop (on a socket bound here, so port 0 works and a busy port fails
with a clear OSError) and the internal TokenService over grpc.aio. `stop()` undoes it in reverse order.
Signals are the caller's business (trainyard_core.service.run), so uvicorn's own signal capture is turned off.

Transport: with the tls_* settings, the TokenService requires mTLS and the authorization table, and every
channel (from one `Channels` pool) presents the gateway's certificate and accepts only the principal it
means to reach: `trainyard://scheduler` for every scheduler replica, `trainyard://node/<id>` for the agent
of that node, `trainyard://checkpoint-store` for the checkpoint-store. HTTP is HTTPS when
http_tls_cert_file/http_tls_key_file are set (a certificate for users, not the mTLS one), plain HTTP otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator

import grpc.aio
import uvicorn
from fastapi import FastAPI

from trainyard.gateway.v1 import gateway_pb2_grpc
from trainyard_core import telemetry
from trainyard_core.audit import AuditLog
from trainyard_core.clock import Clock
from trainyard_core.contract import Role
from trainyard_core.rpc.channels import OWN_CONNECTIONS, Channels
from trainyard_core.rpc.server import GrpcServer, start_grpc_server
from trainyard_core.security import identity
from trainyard_core.service import start_or_undo
from trainyard_core.store import Store
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_check import check_access

from . import audit_http, http_errors, http_methods, http_tracing, openapi, view_fast_path
from .checkpoint_client import CheckpointStoreClient
from .clients import AgentClients, SchedulerClient
from .console.router import make_router as console_router
from .deps import GatewayDeps
from .fleet_metrics import FleetHistory, LatestGpus
from .http_metrics import HttpMetrics
from .job_view import JobView
from .job_view_feed import JobFeed
from .rate_limit import TokenBuckets
from .routers import (
    audit,
    checkpoints,
    health,
    job_operations,
    job_streams,
    jobs,
    metrics,
    nodes,
    pending,
    queues,
    quotas,
    tokens,
    usage,
    whoami,
)
from .settings import GatewaySettings
from .token_service import SERVICE_NAME, TokenServicer
from .tokens import TokenStore

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 10.0

API_DESCRIPTION = """\
Public API of Trainyard, the control plane of a GPU training cluster.

Every route but `/healthz` needs `Authorization: Bearer <token>`. A token has a role (viewer, member,
admin of its team, or operator of the cluster), an expiry and optional scopes; tokens other than operators'
see and touch only their own team's jobs, and each token is rate limited (429 with `Retry-After`).
Errors always answer `{"error": {"code": "...", "message": "..."}}`: 400 when the request breaks this
schema, 409 `failed_precondition` when it is valid but the cluster cannot take it as it is. `OPTIONS` on
any path answers 204 with `Allow`; a method a path does not have answers 405 with `Allow`.
"""


def create_app(deps: GatewayDeps, *, traced: bool = True) -> FastAPI:
    """`traced`: a recorded span per request, which is worth its cost only when spans are exported (the
    trace_exporter setting; off, the request still has a trace id, which its log lines and its calls to the
    services carry: http_tracing.py)."""
    # FastAPI's own telemetry off: http_tracing.py makes the request's span (or its bare trace context), and the
    # gateway's metrics are Prometheus', its logs its own formatter's.
    app = FastAPI(title="Trainyard gateway", version="v1", description=API_DESCRIPTION, redoc_url=None,
                  telemetry={"tracing": False, "operation_spans": False, "metrics": False, "logs": False})
    app.state.deps = deps
    view_fast_path.install(app)  # innermost: the view's answers to GET /v1/jobs/{id}, past every check below
    http_methods.install(app)  # inside the access log and catch-all, which http_errors adds outermost
    http_errors.install(app, HttpMetrics())  # the access log records each request's latency (http_metrics.py)
    audit_http.install(app, getattr(deps, "audit", None))  # the answer waits for its audit entry
    http_tracing.install(app, telemetry.tracer(__name__) if traced else None)  # outermost: all of it in the trace
    routers = [m.router for m in (health, jobs, job_streams, job_operations, checkpoints, pending, nodes, metrics,
                                  queues, quotas, usage, tokens, whoami, audit)]
    for router in routers:
        app.include_router(router)
    # The web console's files, outside the OpenAPI document (deps may be None: the document alone).
    settings = getattr(deps, "settings", None)
    app.include_router(console_router(prometheus_url=getattr(settings, "console_prometheus_url", "")))
    openapi.install(app, routers)
    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the service's stop event owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    # The socket is made with proto=IPPROTO_TCP on purpose: asyncio only sets TCP_NODELAY on accepted
    # connections whose proto says TCP, and socket.create_server leaves it 0. Without NODELAY every
    # keep-alive request waited ~40 ms for the peer's delayed ACK.
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        return sock
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {exc.strerror or exc}") from exc


class GatewayApp:
    """The running gateway. `http_port` and `grpc_port` are the bound ports once `start()` returned."""

    def __init__(self, settings: GatewaySettings, *, store: Store | None = None,
                 clock: Clock | None = None) -> None:
        self.settings = settings
        self.http_port = 0
        self.grpc_port = 0
        self._store = store
        self._owns_store = store is None
        self._clock = clock
        # Every gRPC channel of the gateway: to the scheduler replicas (the configured target and the leaders
        # named by standbys) and to the node agents.
        self._channels: Channels | None = None
        self._feed_channels: Channels | None = None
        self._agents: AgentClients | None = None
        self._grpc: GrpcServer | None = None
        self._job_feed: JobFeed | None = None
        self._scheduler: SchedulerClient | None = None
        self._fleet_history: FleetHistory | None = None
        self._tokens: TokenStore | None = None
        self._http: _EmbeddedServer | None = None
        self._http_task: asyncio.Task[None] | None = None
        self.app: FastAPI | None = None

    async def start(self) -> None:
        await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        s = self.settings
        if self._store is None:
            self._store = EtcdStore.from_options(s.etcd_options())
            await check_access(self._store, s.etcd_prefix)  # a wrong etcd credential stops the start here
        token_store = self._tokens = TokenStore(
            self._store, s.etcd_prefix, cache_ttl_s=s.token_cache_ttl_s, clock=self._clock,
            default_ttl_s=s.token_default_ttl_s, max_ttl_s=s.token_max_ttl_s)
        if s.bootstrap_admin_token is not None:
            record = await token_store.ensure(s.bootstrap_admin_token.get_secret_value(), team="admin",
                                              user="admin", role=Role.OPERATOR,
                                              description="bootstrap operator token (gateway setting)")
            log.info("bootstrap operator token present", extra={"token_id": record.token_id})
        channels = self._channels = Channels(s.tls)
        target = s.scheduler_target
        self._agents = AgentClients(channels, timeout_s=s.request_timeout_s)
        scheduler = SchedulerClient(lambda: channels.get(target, identity.SCHEDULER), timeout_s=s.request_timeout_s,
                                    leader_channel=lambda address: channels.get(address, identity.SCHEDULER),
                                    replicas=s.scheduler_address.split(","), submit_batch_max=s.submit_batch_max,
                                    submit_calls=s.submit_calls)
        self._scheduler = scheduler
        # The view's feed on channels of its own: its stream reconnects while the scheduler restarts, and must not
        # leave the requests' connection in a reconnect backoff that fails the first reads after it is back.
        feed_channels = self._feed_channels = Channels(s.tls, options=OWN_CONNECTIONS)
        view = self._job_view(scheduler, lambda: feed_channels.get(target, identity.SCHEDULER))
        fleet = self._fleet_history = FleetHistory(s.fleet_sample_interval_s, scheduler.list_nodes, clock=self._clock)
        deps = GatewayDeps(settings=s, tokens=token_store, agents=self._agents, store=self._store, job_view=view,
                           scheduler=scheduler, limiter=TokenBuckets(s.rate_limit_per_s, s.rate_limit_burst,
                                                                     clock=self._clock),
                           audit=AuditLog(self._store, s.etcd_prefix, retention_s=s.audit_retention_s(),
                                          clock=self._clock),
                           checkpoints=self._checkpoint_store(channels), fleet_history=fleet,
                           latest_gpus=LatestGpus(self._agents, clock=self._clock))
        self.app = create_app(deps, traced=telemetry.exporting(s.trace_exporter))

        servicer = TokenServicer(token_store)
        self._grpc = await start_grpc_server(
            host=s.grpc_host, port=s.grpc_port, service_names=[SERVICE_NAME], tls=s.tls, audit=deps.audit,
            audit_service="gateway",
            register=lambda server: gateway_pb2_grpc.add_TokenServiceServicer_to_server(servicer, server))
        self.grpc_port = self._grpc.port

        # The OpenAPI document, generated now rather than by the first request (`Allow` reads it: http_methods):
        # it takes the event loop ~0.4 s, which the first requests after a start waited for (the fleet
        # benchmark's submit p99).
        self.app.openapi()
        sock = _listen(s.http_host, s.http_port)
        self.http_port = int(sock.getsockname()[1])
        # access_log off: requests are logged by http_errors.AccessLogAndCatchAll, which never logs
        # headers (so never the Authorization token). log_config None: keep the service's logging.
        # http: uvicorn's C parser (a pinned dependency), named so that a missing one fails the start instead of
        # falling back to h11, which takes about twice the CPU per request.
        config = uvicorn.Config(self.app, http="httptools", log_config=None, access_log=False, lifespan="off",
                                server_header=False, timeout_graceful_shutdown=5,
                                timeout_keep_alive=s.http_keep_alive_s,
                                ssl_certfile=s.http_tls_cert_file or None, ssl_keyfile=s.http_tls_key_file or None)
        try:
            config.load()  # here rather than in serve(), so unusable HTTPS files fail the start with their names
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            sock.close()
            if not s.http_tls:
                raise
            raise OSError(f"http_tls_cert_file {s.http_tls_cert_file} / http_tls_key_file {s.http_tls_key_file}: "
                          f"cannot serve HTTPS with them: {err}") from err
        self._http = _EmbeddedServer(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]), name="gateway-http")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._http.started:
            if self._http_task.done():
                exc = self._http_task.exception()
                raise OSError(f"HTTP server failed to start: {exc!r}")
            if time.monotonic() > deadline:
                raise OSError(f"HTTP server did not start within {STARTUP_TIMEOUT_S}s")
            await asyncio.sleep(0.01)
        scheme = "https" if s.http_tls else "http"
        log.info("gateway serving", extra={"http_url": f"{scheme}://{s.http_host}:{self.http_port}",
                                           "grpc_port": self.grpc_port, "grpc_mtls": s.tls is not None,
                                           "scheduler_address": s.scheduler_address,
                                           "checkpoint_store_address": s.checkpoint_store_address})

    def _job_view(self, scheduler: SchedulerClient, channel: Callable[[], grpc.aio.Channel]) -> JobView | None:
        """The read view and its feed (started here: the view answers nothing until its first snapshot)."""
        if not self.settings.job_view:
            return None
        view = JobView(wait_s=self.settings.job_view_wait_s)
        scheduler.on_write = view.wrote
        self._job_feed = JobFeed(view, channel)
        self._job_feed.start()
        return view

    def _checkpoint_store(self, channels: Channels) -> CheckpointStoreClient | None:
        address = self.settings.checkpoint_store_address
        if not address:
            return None
        return CheckpointStoreClient(lambda: channels.get(address, identity.CHECKPOINT_STORE),
                                     timeout_s=self.settings.request_timeout_s)

    async def stop(self) -> None:
        """Idempotent; safe after a failed start."""
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._http_task), SHUTDOWN_TIMEOUT_S)
            except TimeoutError:
                self._http.force_exit = True
                with contextlib.suppress(Exception):
                    await self._http_task
            except Exception:
                log.exception("HTTP server ended with an error")
        self._http, self._http_task = None, None
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
            self._grpc = None
        if self._scheduler is not None:
            await self._scheduler.close()
            self._scheduler = None
        if self._job_feed is not None:
            await self._job_feed.stop()
            self._job_feed = None
        if self._fleet_history is not None:
            await self._fleet_history.stop()
            self._fleet_history = None
        if self._agents is not None:
            self._agents.forget()
            self._agents = None
        for pool in (self._channels, self._feed_channels):
            if pool is not None:
                await pool.close()
        self._channels = self._feed_channels = None
        if self._tokens is not None:
            await self._tokens.close()
            self._tokens = None
        if self._store is not None and self._owns_store:
            await self._store.close()
            self._store = None
