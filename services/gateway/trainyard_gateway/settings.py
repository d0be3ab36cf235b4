"""Settings of the gateway (environment `TRAINYARD_GATEWAY_<SETTING>`, flags `--http-port` etc.)."""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import ClassVar

from pydantic import Field, SecretStr, field_validator, model_validator

from trainyard_core import contract
from trainyard_core.addresses import address_list, host_port
from trainyard_core.security import identity
from trainyard_core.security.identity import Principal
from trainyard_core.settings import EtcdSettings

from .tokens import SECRET_PREFIX, is_well_formed_secret

log = logging.getLogger(__name__)


def _literal_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return None


def _resolve(host: str, port: int) -> list[str]:
    """host:port → every address it resolves to now, as ip:port ([ip]:port for IPv6)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        log.warning("scheduler address %s:%d does not resolve (%s); leaving it out", host, port, e)
        return []
    out: list[str] = []
    for family, *_, sockaddr in infos:
        ip = str(sockaddr[0])
        text = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if text not in out:
            out.append(text)
    return out


class GatewaySettings(EtcdSettings):
    """Trainyard gateway: the public HTTP/JSON API and the internal TokenService."""

    env_prefix: ClassVar[str] = "TRAINYARD_GATEWAY_"

    http_host: str = Field("127.0.0.1", description="address the HTTP API listens on")
    http_port: int = Field(8080, ge=0, le=65535, description="HTTP port; 0 picks a free one")
    http_keep_alive_s: int = Field(75, ge=1, le=3600, description="how long an idle HTTP connection is kept open. "
                                   "Longer than any client's or proxy's idle pool (httpx 5 s, nginx and cloud load "
                                   "balancers 60 s): the side that closes an idle connection must be the client, "
                                   "or a request sent on it as the server closes it fails (a dropped connection, "
                                   "a proxy's 502). uvicorn's own default, 5 s, raced httpx's 5 s")
    grpc_host: str = Field("127.0.0.1", description="address of the internal gRPC TokenService")
    grpc_port: int = Field(50054, ge=0, le=65535, description="gRPC port of TokenService; 0 picks a free one")
    scheduler_address: str = Field("127.0.0.1:50051", description="host:port of the scheduler's gRPC API; "
                                   "every replica, comma-separated (IP addresses or DNS names): the next one is "
                                   "used while one is down")
    checkpoint_store_address: str = Field("", description="host:port of the checkpoint-store's gRPC API, for the "
                                          "/v1/jobs/{job_id}/checkpoints routes; empty: those routes answer 503")
    # The local cluster's: production creates its first token offline (python -m trainyard_gateway.tokens_admin).
    bootstrap_admin_token: SecretStr | None = Field(
        None, description=f"operator token ('{SECRET_PREFIX}...', never expiring) stored (hashed) at start for team "
                          "and user 'admin'; for the local cluster, not for production")
    request_timeout_s: float = Field(10.0, gt=0, description="deadline of each call to the scheduler or an agent")
    # Submits that arrive while `submit_calls` calls to the scheduler are in flight go together in the next one
    # (submit_batcher.py): a burst of submits costs the scheduler a few calls, not one each.
    submit_batch_max: int = Field(128, ge=1, le=contract.MAX_SUBMIT_BATCH,
                                  description="most submits sent to the scheduler in one call; 1: each its own call")
    submit_calls: int = Field(4, ge=1, le=64, description="most submit calls to the scheduler in flight at once "
                              "(with submit_batch_max above 1); a submit arriving beyond them waits for the next")
    # How long a verified token is trusted without re-reading etcd. A token revoked through another
    # gateway replica keeps working here for at most this long; revocation through this one is immediate.
    token_cache_ttl_s: float = Field(5.0, ge=0, description="seconds a verified token is cached in memory")
    max_log_lines: int = Field(100_000, ge=1, description="most log lines one /logs answer returns")
    token_default_ttl_s: float = Field(contract.ttl_seconds(contract.DEFAULT_TOKEN_TTL), gt=0,
                                       description="lifetime of a new token whose creator gives no ttl")
    token_max_ttl_s: float = Field(365 * contract.DAY_S, gt=0, le=contract.MAX_TOKEN_TTL_S,
                                   description="the longest ttl a new token may be given")
    rate_limit_per_s: float = Field(50.0, ge=0, description="requests per second each token may make on average "
                                    "(per gateway replica); 0 turns rate limiting off")
    rate_limit_burst: int = Field(200, ge=1, description="requests a token may make at once before "
                                  "rate_limit_per_s applies")
    # The read view (job_view.py): reads of live jobs answered from a copy fed by the scheduler's JobWatchService.
    job_view: bool = Field(True, description="answer reads of live jobs (GET /v1/jobs/{id}, the lists it can "
                           "answer exactly, ?watch=true) from a view fed by the scheduler's job watch stream; off: "
                           "every read asks the scheduler, and ?watch=true answers 503")
    job_view_wait_s: float = Field(1.0, gt=0, le=60, description="how long a read waits for the view to show a "
                                   "write it must see (the client's own) before it asks the scheduler instead")
    # HTTPS of the public API. Not the mTLS certificate (tls_*): browsers and the CLI verify this one, so it
    # is usually a public certificate. Left empty, HTTP stays plain (a load balancer terminating TLS).
    http_tls_cert_file: str = Field("", description="server certificate (PEM, chain after the leaf) of the HTTP "
                                    "API; with http_tls_key_file the API is served over HTTPS, without both it "
                                    "is plain HTTP")
    http_tls_key_file: str = Field("", description="the private key (PEM, unencrypted) of http_tls_cert_file")
    # The web console (/console) and its metrics API (fleet_metrics.py).
    fleet_sample_interval_s: float = Field(15.0, ge=0.05, le=3600, description=(
        "how often the gateway records the fleet's allocation (from the scheduler's node list) for GET "
        "/v1/fleet/metrics and the console's charts, from the first such request on; it keeps the last 24 hours "
        "or 5,760 samples, whichever is shorter"))
    console_prometheus_url: str = Field("", max_length=2000, pattern=r"^(https?://[^\s\"'<>]+)?$", description=(
        "a Prometheus server's URL the console links to (http:// or https://); empty: no link"))

    def principal(self) -> Principal:
        return identity.GATEWAY

    @property
    def http_tls(self) -> bool:
        return bool(self.http_tls_cert_file)

    @model_validator(mode="after")
    def _http_tls_complete(self) -> GatewaySettings:
        if bool(self.http_tls_cert_file) != bool(self.http_tls_key_file):
            given, missing = (("http_tls_cert_file", "http_tls_key_file") if self.http_tls_cert_file
                              else ("http_tls_key_file", "http_tls_cert_file"))
            raise ValueError(f"HTTPS needs http_tls_cert_file and http_tls_key_file together: {given} is set, "
                             f"{missing} is not (set both for HTTPS, or neither for plain HTTP)")
        return self

    @model_validator(mode="after")
    def _ttls_ordered(self) -> GatewaySettings:
        if self.token_default_ttl_s > self.token_max_ttl_s:
            raise ValueError(f"token_default_ttl_s ({self.token_default_ttl_s:g}) is longer than token_max_ttl_s "
                             f"({self.token_max_ttl_s:g}): lower the default or raise the maximum")
        return self

    @field_validator("scheduler_address")
    @classmethod
    def _check_scheduler_address(cls, v: str) -> str:
        targets = address_list(v)
        if not targets:
            raise ValueError("give at least one scheduler address (host:port[,host:port...])")
        for t in targets:
            if host_port(t) is None:
                raise ValueError(f"{t!r} is not host:port (e.g. 10.0.0.5:50051 or sched1.example.internal:50051)")
        return ",".join(targets)

    @field_validator("checkpoint_store_address")
    @classmethod
    def _check_checkpoint_store_address(cls, v: str) -> str:
        v = v.strip()
        if v and host_port(v) is None:
            raise ValueError(f"{v!r} is not host:port (e.g. ckpt.example.internal:50053), or empty for none")
        return v

    @property
    def scheduler_target(self) -> str:
        """The gRPC target. One address: itself (gRPC resolves a DNS name, and re-resolves it, itself; a name
        with a record per replica fails over like a list). Several: an ipv4: (or ipv6:) list that gRPC's
        pick_first tries in order, moving on while one is unreachable. DNS names in a list are resolved here,
        once, when the gateway starts (gRPC has no list of names): restart the gateway after a replica moves
        to another address. Names that do not resolve are left out with a warning; OSError when none does."""
        targets = self.scheduler_address.split(",")
        if len(targets) == 1:
            return targets[0]
        resolved: list[str] = []
        for t in targets:
            parsed = host_port(t)
            assert parsed is not None  # checked by the validator
            host, port = parsed
            ip = _literal_ip(host)
            found = [t] if ip is not None else _resolve(host, port)
            resolved += [r for r in found if r not in resolved]
        v4 = [r for r in resolved if not r.startswith("[")]
        if v4:
            if len(v4) < len(resolved):  # one gRPC address list holds one family
                log.warning("scheduler addresses: IPv6 ones left out beside IPv4 ones: %s",
                            ",".join(r for r in resolved if r not in v4))
            return "ipv4:" + ",".join(v4)
        if resolved:
            return "ipv6:" + ",".join(resolved)
        raise OSError(f"none of the scheduler addresses {self.scheduler_address} resolves")

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
