"""grpc.aio server bootstrap: the same interceptors, health service and reflection for every service."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ..audit import AuditSink
from ..security.authz import AuthorizationInterceptor, JobBinding
from ..security.identity import Principal
from ..security.pki import CertFiles
from ..security.tls import ClientTls, server_credentials, target_name_option
from .admission import AdmissionInterceptor
from .audit import AuditInterceptor, RequestIdClientInterceptor
from .errors import ErrorMappingInterceptor
from .liveness import merged
from .metrics import RpcMetricsInterceptor

log = logging.getLogger(__name__)

# Large enough for a 10k-node ListNodes answer; well below etcd's request cap is not a concern here.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# No BDP probes: gRPC's C core answers data it receives with a PING to size its flow-control window for bulk
# transfers, which a control plane of small messages does not make (checkpoint bytes go to storage, not over
# gRPC). On TLS each probe is a record written and read on both ends: measured on this machine (a bare
# grpc.aio echo server, 100 mTLS streams, a 600-byte message every 0.5 s each), 630-710 µs of server CPU per
# message with probes, 330-340 µs without; plaintext 215-240 either way. Both ends must turn them off.
NO_BDP_PROBE = ("grpc.http2.bdp_probe", 0)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    NO_BDP_PROBE,
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    NO_BDP_PROBE,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    port: int
    health: HealthServicer

    async def set_serving(self, service: str, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(service, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_grpc_server(
    *,
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: CertFiles | None = None,
    job_binding: JobBinding | None = None,
    audit: AuditSink | None = None,
    audit_service: str = "",
    options: Sequence[tuple[str, int | str]] = (),
    admission: AdmissionInterceptor | None = None,
) -> GrpcServer:
    """Start a server with the metrics and error-mapping interceptors, health and reflection; port 0 picks a
    free one.

    `register` adds the service's servicers; `service_names` are their full names (for health and
    reflection); `job_binding` checks the table's `as_job` rules (the checkpoint-store's). With `tls`, the
    port requires mTLS (certificates reloaded when rotated) and every call is
    authorized by the table in `security/authz.py`; without, it is plaintext and unauthorized. With `audit`,
    every mutating call (`authz.AUDITED`), refused ones included, is recorded there as `audit_service`.
    `options`: gRPC server options on top of (and replacing) the shared ones, e.g. the scheduler's keepalive.
    `admission` (rpc/admission.py) sits outside the audit: a call it refuses at once did nothing to record.
    """
    # Metrics outermost: they count the status the caller gets, after the error mapping (rpc/metrics.py).
    chain: list[grpc.aio.ServerInterceptor] = [RpcMetricsInterceptor(), ErrorMappingInterceptor()]
    if admission is not None:
        chain.append(admission)
    if audit is not None:
        chain.append(AuditInterceptor(audit, audit_service, authorized=tls is not None))
    if tls is not None:
        chain.append(AuthorizationInterceptor(jobs=job_binding))
    server = grpc.aio.server(interceptors=[*chain, *interceptors], options=merged(SERVER_OPTIONS, options))
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, server_credentials(tls)) if tls is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (address in use or not available)")
    await server.start()
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server=server, port=bound, health=health)


def insecure_channel(target: str, extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, *extra_options],
                                     interceptors=[RequestIdClientInterceptor()])


def secure_channel(target: str, tls: ClientTls, expected: Principal,
                   extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An mTLS channel presenting `tls`'s certificate, that accepts only a server whose certificate names
    `expected` (whatever address `target` resolves to)."""
    return grpc.aio.secure_channel(target, tls.credentials(),
                                   options=[*CHANNEL_OPTIONS, target_name_option(expected), *extra_options],
                                   interceptors=[RequestIdClientInterceptor()])


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop`; the service then shuts down in order."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
