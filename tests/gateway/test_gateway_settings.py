"""The gateway's settings: every scheduler replica as host:port, DNS names as the agents take them."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from trainyard_core.settings import SettingsError, load_settings
from trainyard_gateway.settings import GatewaySettings


def load(*argv: str, env: dict[str, str] | None = None) -> GatewaySettings:
    return load_settings(GatewaySettings, prog="trainyard-gateway", argv=list(argv), env=env or {})


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """A resolver with the names the test puts in it; anything else does not resolve."""
    names: dict[str, list[str]] = {}

    def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                for ip in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names


def test_dns_names_are_accepted_like_the_agents() -> None:
    """The example gateway.yaml lists sched1/sched2.example.internal; the gateway refused a list of names."""
    s = load("--scheduler-address", " sched1.example.internal:50051, sched2.example.internal:50051 ")
    assert s.scheduler_address == "sched1.example.internal:50051,sched2.example.internal:50051"


def test_one_address_is_the_grpc_target_itself(dns: dict[str, list[str]]) -> None:
    # gRPC resolves (and re-resolves) a single name itself: nothing is looked up here.
    assert load("--scheduler-address", "scheduler.example.internal:50051").scheduler_target == \
        "scheduler.example.internal:50051"


def test_ip_replicas_become_an_ipv4_list(dns: dict[str, list[str]]) -> None:
    assert load("--scheduler-address", "10.0.0.5:50051,10.0.0.6:50051").scheduler_target == \
        "ipv4:10.0.0.5:50051,10.0.0.6:50051"


def test_named_replicas_are_resolved_in_order(dns: dict[str, list[str]], caplog: pytest.LogCaptureFixture) -> None:
    dns.update({"sched1": ["10.0.0.5"], "sched2": ["10.0.0.6", "10.0.0.7", "fd00::6"]})
    s = load("--scheduler-address", "sched1:50051,gone.example:50051,sched2:50051,10.0.0.5:50051")
    assert s.scheduler_target == "ipv4:10.0.0.5:50051,10.0.0.6:50051,10.0.0.7:50051"
    assert "gone.example:50051 does not resolve" in caplog.text and "[fd00::6]:50051" in caplog.text


def test_ipv6_only_replicas(dns: dict[str, list[str]]) -> None:
    dns.update({"sched1": ["fd00::5"]})
    assert load("--scheduler-address", "sched1:50051,[fd00::6]:50051").scheduler_target == \
        "ipv6:[fd00::5]:50051,[fd00::6]:50051"


def test_no_resolvable_replica_stops_the_start(dns: dict[str, list[str]]) -> None:
    s = load("--scheduler-address", "a.example:1,b.example:2")
    with pytest.raises(OSError, match=r"none of the scheduler addresses a\.example:1,b\.example:2 resolves"):
        _ = s.scheduler_target


@pytest.mark.parametrize(("value", "message"), [
    ("", "give at least one scheduler address"),
    ("sched1", "'sched1' is not host:port"),
    ("sched1:50051,sched2:port", "'sched2:port' is not host:port"),
    ("sched1:0", "'sched1:0' is not host:port"),
])
def test_bad_scheduler_addresses_are_named(value: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load("--scheduler-address", value)
    assert message in info.value.message


def test_an_unknown_gateway_variable_is_refused() -> None:
    with pytest.raises(SettingsError, match=r"TRAINYARD_GATEWAY_BOOTSTRAP_TOKEN is no setting.*"
                                            r"TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN"):
        load(env={"TRAINYARD_GATEWAY_BOOTSTRAP_TOKEN": "ty_x"})
