"""A scheduler's start against real etcd: its UDP pulse port is its gRPC port's number, and a start that fails
leaves nothing listening (a test harness that starts replicas in-process, and a supervisor that retries, would
otherwise meet a server nobody stops)."""

from __future__ import annotations

import errno
import socket

import pytest

from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.etcd_secure import settings_of
from trainyard_scheduler import app as app_module
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings


def _settings(etcd: EtcdOptions, prefix: str, port: int) -> SchedulerSettings:
    return SchedulerSettings(**settings_of(etcd), etcd_prefix=prefix.rstrip("/"), listen_port=port,
                             reconcile_interval_s=0.2)


def _tcp_listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_a_configured_port_whose_udp_twin_is_taken_fails_the_start_and_leaves_nothing_listening(
        etcd_options: EtcdOptions, key_prefix: str) -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("", port))
        app = SchedulerApp(_settings(etcd_options, key_prefix, port))
        with pytest.raises(OSError, match=f"cannot listen for liveness pulses on UDP .*:{port}"):
            await app.start()
    assert not _tcp_listening(port), "the failed start left its gRPC server listening"


async def test_with_port_0_a_number_taken_over_udp_is_passed_over(etcd_options: EtcdOptions, key_prefix: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC picks any free TCP port; the first one's number is taken over UDP (made so here): the server on it
    stops and the scheduler serves on another, pulses included."""
    real = app_module.pulses.start_endpoint
    refused: list[int] = []

    async def first_taken(host: str, port: int, sessions: object) -> object:
        if not refused:
            refused.append(port)
            raise OSError(f"cannot listen for liveness pulses on UDP {host}:{port}") from OSError(
                errno.EADDRINUSE, "Address already in use")
        return await real(host, port, sessions)  # type: ignore[arg-type]
    monkeypatch.setattr(app_module.pulses, "start_endpoint", first_taken)
    app = SchedulerApp(_settings(etcd_options, key_prefix, 0))
    await app.start()
    try:
        assert app.grpc_port not in (0, refused[0])
        assert _tcp_listening(app.grpc_port)
        assert not _tcp_listening(refused[0]), "the server on the refused port was left listening"
    finally:
        await app.stop()
