"""Settings of the gateway (env prefix `TRAINYARD_GATEWAY_`, flags `--http-port` etc.)."""

from __future__ import annotations

import ipaddress

from pydantic import Field, SecretStr, field_validator

from trainyard_core.addresses import address_list, host_port
from trainyard_core.settings import BaseSettings

from .tokens import SECRET_PREFIX, is_well_formed_secret


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        return False


class GatewaySettings(BaseSettings):
    """Trainyard gateway: the public HTTP/JSON API and the internal TokenService."""

    http_host: str = Field("127.0.0.1", description="address the HTTP API listens on")
    http_port: int = Field(8080, ge=0, le=65535, description="HTTP port; 0 picks a free one")
    grpc_host: str = Field("127.0.0.1", description="address of the internal gRPC TokenService")
    grpc_port: int = Field(50054, ge=0, le=65535, description="gRPC port of TokenService; 0 picks a free one")
    scheduler_address: str = Field("127.0.0.1:50051", description="host:port of the scheduler's gRPC API; "
                                   "several replicas as ip:port,ip:port (the next one is used while one is down)")
    bootstrap_admin_token: SecretStr | None = Field(
        None, description=f"admin token ('{SECRET_PREFIX}...') stored (hashed) at start for team and user 'admin'")
    request_timeout_s: float = Field(10.0, gt=0, description="deadline of each call to the scheduler or an agent")
    # How long a verified token is trusted without re-reading etcd. A token revoked through another
    # gateway replica keeps working here for at most this long; revocation through this one is immediate.
    token_cache_ttl_s: float = Field(5.0, ge=0, description="seconds a verified token is cached in memory")
    max_log_lines: int = Field(100_000, ge=1, description="most log lines one /logs answer returns")

    @field_validator("scheduler_address")
    @classmethod
    def _check_scheduler_address(cls, v: str) -> str:
        targets = address_list(v)
        if not targets:
            raise ValueError("give at least one scheduler address (host:port[,ip:port...])")
        for t in targets:
            parsed = host_port(t)
            if parsed is None:
                raise ValueError(f"{t!r} is not host:port (e.g. 10.0.0.5:50051)")
            if len(targets) > 1 and not _is_ipv4(parsed[0]):
                raise ValueError(f"{t!r}: several scheduler replicas are given as IPv4 ip:port (a DNS name that "
                                 "resolves to every replica can be given alone)")
        return ",".join(targets)

    @property
    def scheduler_target(self) -> str:
        """The gRPC target: the address itself, or for several replicas an ipv4: list that gRPC's pick_first
        tries in order, moving on while one is unreachable."""
        targets = self.scheduler_address.split(",")
        return targets[0] if len(targets) == 1 else "ipv4:" + ",".join(targets)

    @field_validator("bootstrap_admin_token")
    @classmethod
    def _well_formed(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if not is_well_formed_secret(value.get_secret_value()):
            # The message must not echo the value: it is a secret.
            raise ValueError(
                f"must look like '{SECRET_PREFIX}' followed by at least 20 URL-safe characters; generate one "
                "with: python -c \"import secrets; print('ty_' + secrets.token_urlsafe(32))\"")
        return value
