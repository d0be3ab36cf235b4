"""Settings of the node agent (`trainyard-agent`): flags `--field-name`, env `TRAINYARD_AGENT_FIELD_NAME`,
or a YAML/JSON file (`--config`). Built once in main.py and passed down; nothing else reads the env.

Derived defaults (filled when the field is left empty): `node_id` from the host name, `advertise_host`
from `listen_host` when that is a concrete address, else (a wildcard such as 0.0.0.0) the host's fully
qualified name (`socket.getfqdn()`, what `hostname -f` prints: a short name often does not resolve on the
scheduler's host), `worker_address` from `advertise_host`, `state_dir` under
`~/.local/state/trainyard/agent/<node_id>`.

Files named by settings are read and validated here, so a mistake in them stops the agent at start-up
with exit code 2 and a message naming the file and the entry: `topology_file` (its labels for this node
are merged under `labels`), `health_policy_file` (checked here, loaded by the app), `run_as_file` (its
teams are merged under `run_as`, whose own entries win). Whether the agent can keep the teams apart as
`run_as` and `single_tenant` say is decided at start (`tenancy.Tenancy.decide`): it needs root, and one
of the two.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from trainyard_core.addresses import address_list, host_port
from trainyard_core.ids import is_valid_id
from trainyard_core.security import identity
from trainyard_core.security.identity import InvalidPrincipal, Principal
from trainyard_core.settings import BaseSettings

from .health.policy import PolicyError, load_policy
from .nvml.profiles import PROFILES
from .site_topology import LABEL_KEY_RE, labels_for
from .tenancy import check_run_as, read_run_as_file

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def default_node_id(hostname: str) -> str:
    """A valid node id from a host name: first label, lower case, other characters turned into '-'."""
    base = re.sub(r"[^a-z0-9-]", "-", hostname.split(".")[0].lower()).strip("-")
    if not base or not base[0].isalpha():
        base = f"node-{base}" if base else "node"
    base = base[:63].rstrip("-")
    return base if len(base) >= 3 else f"{base}-node"


def host_fqdn(hostname: str) -> str:
    """The host's fully qualified name, as `hostname -f` prints it; the plain host name where the resolver
    knows no better (getfqdn answers "localhost" on hosts whose name maps to a loopback address)."""
    fqdn = socket.getfqdn(hostname)
    return hostname if fqdn == "localhost" or fqdn.startswith("localhost.") else fqdn


class AgentSettings(BaseSettings):
    """Trainyard node agent: reports this host's GPUs to the scheduler and runs the workers it is sent."""

    env_prefix: ClassVar[str] = "TRAINYARD_AGENT_"

    node_id: str = Field("", description="Node name in the cluster (default: derived from the host name)")
    scheduler_address: str = Field("127.0.0.1:50051", description="host:port of the scheduler's NodeService; "
                                   "several, comma-separated, for replicas (the agent moves on until one leads)")
    listen_host: str = Field("127.0.0.1", description="Address the agent's gRPC server binds to")
    listen_port: int = Field(0, ge=0, le=65535, description="Port of the agent's gRPC server; 0 picks a free one")
    advertise_host: str = Field("", description="Host the scheduler uses to reach this agent (default: listen_host "
                                               "when it is a concrete address, else this host's FQDN, as "
                                               "hostname -f prints it)")
    worker_address: str = Field("", description="MASTER_ADDR other nodes use to reach workers here "
                                                "(default: advertise_host)")
    gpu_profile: str = Field("", description="Simulated GPUs from a profile (" + ", ".join(sorted(PROFILES))
                                             + "); empty reads the real GPUs through NVML")
    labels: dict[str, str] = Field(default_factory=dict, description="Node labels, e.g. rack=r1,switch=s3 (win over "
                                                                    "topology_file)")
    topology_file: str = Field("", description="YAML/JSON file with this node's rack/switch labels (a `nodes` "
                                               "table for the whole site, or `labels`)")
    health_policy_file: str = Field("", description="YAML/JSON file overriding XID actions and health thresholds")
    state_dir: str = Field("", description="Worker logs and records (default ~/.local/state/trainyard/agent/"
                                           "<node_id>)")
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60,
                                        description="How often GPU metrics and health are read; also the "
                                                    "heartbeat refresh when the scheduler names none (it does: "
                                                    "its heartbeat_interval_ms)")
    health_counters_interval_s: float = Field(10.0, gt=0, le=3600,
                                              description="How often the GPU error counters (ECC, remapped rows, "
                                                          "NVLink, PCIe) are read; memory error events trigger "
                                                          "a read at once")
    stop_grace_s: float = Field(10.0, ge=0, le=3600,
                                description="SIGTERM → SIGKILL grace when a stop request gives none")
    worker_env: dict[str, str] = Field(default_factory=dict,
                                       description="Defaults added to every worker's env; the job's env wins")
    log_max_bytes: int = Field(16 * 1024 * 1024, ge=4096,
                               description="Size of one rank's log file before it is rotated")
    log_backups: int = Field(2, ge=0, le=100, description="Rotated log files kept per rank")
    audit_max_bytes: int = Field(64 * 1024 * 1024, ge=4096, description="Size of the agent's audit log "
                                 "(<state_dir>/audit.jsonl) before it is rotated")
    audit_backups: int = Field(5, ge=0, le=1000, description="Rotated audit log files kept")
    worker_restart_policy: Literal["adopt", "stop"] = Field(
        "adopt", description="What a restarted agent does with workers of its previous life that still run: "
        "adopt (keep them and supervise them again) or stop (SIGTERM, grace, SIGKILL, and report)")
    worker_cpu_binding: bool = Field(True, description="Bind each worker to the CPUs near its GPUs (NUMA affinity)")
    kill_workers_on_stop: bool = Field(False, description="Stop running workers when the agent shuts down "
                                                          "(local cluster; their jobs are restarted as after a "
                                                          "lost node); off so an agent restart keeps jobs")
    run_as: dict[str, str] = Field(default_factory=dict,
                                   description="The Unix identity each team's workers run as, e.g. "
                                               "ml=2001:2001,research=alice:research (uid:gid, user:group or a "
                                               "user name; ids from 1000 up, one uid per team). Needs root")
    run_as_file: str = Field("", description="Site file of the same mapping, one 'team uid:gid' per line, '#' "
                                             "comments; run_as entries win")
    single_tenant: bool = Field(False, description="Run every worker as the agent's own user (one team per host, "
                                                   "or a development cluster); without it, or run_as, the agent "
                                                   "does not start")
    workdir_root: str = Field("", description="Where each job's working directory is made, <workdir_root>/<job_id> "
                                              "(default <state_dir>/work); with run_as, every directory above it "
                                              "must be passable by others (o+x)")
    reconnect_initial_s: float = Field(0.2, gt=0, le=60, description="First retry delay towards the scheduler")
    reconnect_max_s: float = Field(2.0, gt=0, le=600, description="Longest retry delay towards the scheduler "
                                   "(keep it under the scheduler's leader_grace_s)")

    @model_validator(mode="before")
    @classmethod
    def _derive_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        hostname = socket.gethostname()
        if not data.get("node_id"):
            data["node_id"] = default_node_id(hostname)
        listen_host = str(data.get("listen_host") or "127.0.0.1")
        if not data.get("advertise_host"):
            # A wildcard bind address cannot be dialled; the fully qualified name can, from other hosts
            # (the short name only within the host's own search domain).
            data["advertise_host"] = host_fqdn(hostname) if listen_host in _WILDCARD_HOSTS else listen_host
        if not data.get("worker_address"):
            data["worker_address"] = data["advertise_host"]
        if not data.get("state_dir") and isinstance(data["node_id"], str):
            data["state_dir"] = str(Path("~/.local/state/trainyard/agent").expanduser() / data["node_id"])
        if not data.get("workdir_root") and isinstance(data.get("state_dir"), str):
            data["workdir_root"] = str(Path(data["state_dir"]).expanduser() / "work")
        run_as_file = data.get("run_as_file")
        if run_as_file and isinstance(run_as_file, str):
            data["run_as"] = {**read_run_as_file(run_as_file), **dict(data.get("run_as") or {})}
        topology = data.get("topology_file")
        if topology and isinstance(data["node_id"], str) and is_valid_id(data["node_id"]):
            # The file's labels first, so labels given in the settings themselves win.
            data["labels"] = {**labels_for(str(topology), data["node_id"]), **dict(data.get("labels") or {})}
        return data

    @field_validator("node_id")
    @classmethod
    def _check_node_id(cls, v: str) -> str:
        if not is_valid_id(v):
            raise ValueError(f"{v!r} is not a valid node id: use 3-63 lower-case letters, digits and '-', "
                             "starting with a letter (e.g. gpu-node-01)")
        return v

    @field_validator("scheduler_address")
    @classmethod
    def _check_address(cls, v: str) -> str:
        targets = address_list(v)
        if not targets:
            raise ValueError("give at least one scheduler address (host:port[,host:port...])")
        for t in targets:
            if "://" in t or t.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
                continue  # a gRPC target URI; grpc validates it when dialling
            if host_port(t) is None:
                raise ValueError(f"{t!r} is not host:port (e.g. 10.0.0.5:50051) or a gRPC target URI")
        return ",".join(targets)

    @field_validator("gpu_profile")
    @classmethod
    def _check_profile(cls, v: str) -> str:
        if v and v not in PROFILES:
            raise ValueError(f"unknown GPU profile {v!r}; known profiles: {', '.join(sorted(PROFILES))}")
        return v

    @field_validator("worker_env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_NAME_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if "\0" in value:
                raise ValueError(f"value of {key} contains a NUL byte")
        return v

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not LABEL_KEY_RE.match(key):
                raise ValueError(f"label key {key!r} must be 1-63 letters, digits, '.', '_', '/' or '-', "
                                 "starting and ending with a letter or digit")
        return v

    @field_validator("health_policy_file")
    @classmethod
    def _check_policy(cls, v: str) -> str:
        if v:
            try:
                load_policy(v)
            except PolicyError as e:
                raise ValueError(e.message) from None
        return v

    @field_validator("run_as")
    @classmethod
    def _check_run_as(cls, v: dict[str, str]) -> dict[str, str]:
        check_run_as(v)  # names are looked up here: a user missing on this host stops the agent at start
        return v

    @field_validator("workdir_root")
    @classmethod
    def _check_workdir_root(cls, v: str) -> str:
        path = Path(v).expanduser().absolute()
        if path.exists() and not path.is_dir():
            raise ValueError(f"{v} exists and is not a directory")
        return str(path)

    @field_validator("state_dir")
    @classmethod
    def _check_state_dir(cls, v: str) -> str:
        path = Path(v).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"{v} exists and is not a directory")
        return str(path)

    @model_validator(mode="after")
    def _check_backoff(self) -> AgentSettings:
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError(f"reconnect_max_s ({self.reconnect_max_s}) must be at least reconnect_initial_s "
                             f"({self.reconnect_initial_s})")
        return self

    @model_validator(mode="after")
    def _check_tenancy(self) -> AgentSettings:
        if self.single_tenant and self.run_as:
            raise ValueError("single_tenant=true and run_as (or run_as_file) exclude each other: set one or the other")
        return self

    @model_validator(mode="after")
    def _check_tls_name(self) -> AgentSettings:
        if self.tls is not None:
            try:
                identity.node(self.node_id)
            except InvalidPrincipal as exc:
                raise ValueError(f"node_id {self.node_id!r} cannot be named by a certificate: {exc}") from None
        return self

    def principal(self) -> Principal:
        """The agent's certificate names its own node: the scheduler reaches this node only through it, and
        this node registers and heartbeats only as itself."""
        return identity.node(self.node_id)

    @property
    def simulated(self) -> bool:
        return bool(self.gpu_profile)

    def agent_address(self, port: int) -> str:
        host = self.advertise_host
        return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def state_path(settings: AgentSettings) -> Path:
    """The state directory, created with owner-only permissions (worker logs can hold secrets)."""
    path = Path(settings.state_dir)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


__all__ = ["AgentSettings", "default_node_id", "state_path"]
