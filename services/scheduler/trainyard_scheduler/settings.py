"""Settings of the scheduler (flags, `TRAINYARD_SCHEDULER_<SETTING>` environment, optional YAML/JSON file)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from trainyard_core.errors import InvalidArgument
from trainyard_core.rpc.pulse import PULSE_INTERVAL_S
from trainyard_core.security import identity
from trainyard_core.security.identity import Principal
from trainyard_core.settings import EtcdSettings

from .domain.queues import DEFAULT_CLASS, DEFAULT_CLASSES, PolicyConfig, PriorityClass, validate_classes
from .domain.usage import Pricing
from .pace import PACE_S_PER_PENDING_JOB

# Dense BF16 training throughput relative to an A100, roughly; a site should measure its own. Keys are the
# model names agents report (NVML's name, vendor prefix dropped, spaces as dashes).
DEFAULT_SPEED_FACTORS = {
    "A100-SXM4-80GB": 1.0,
    "A100-SXM4-40GB": 1.0,
    "H100-80GB-HBM3": 3.0,
    "L40S": 0.9,
    "Instinct-MI300X": 2.5,
}

# The longest history retention a setting takes (a century): anything longer is a typo for 0, "forever".
MAX_HISTORY_RETENTION_DAYS = 36_500


class PriorityClassSettings(BaseModel):
    """One priority class. On the command line: `--priority-classes low=-100,can_preempt=false` (the bare
    number is `value`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    value: int = Field(ge=-100_000, le=100_000)
    preemptible: bool = True
    can_preempt: bool = True


class SchedulerSettings(EtcdSettings):
    """Trainyard scheduler: gang placement of jobs on GPU nodes, backed by etcd."""

    env_prefix: ClassVar[str] = "TRAINYARD_SCHEDULER_"

    listen_host: str = "127.0.0.1"
    listen_port: int = Field(50051, ge=0, le=65535, description="gRPC port (TCP), and the same number over UDP for "
                             "the agents' liveness pulses; 0 picks a free one")
    advertise_address: str = Field("", description="host:port other components use to reach this replica")
    node_timeout_s: float = Field(2.5, gt=0, description="a node without proof of life this long is lost: its "
                                  "agent's liveness pulses (every 1 s, and once more 0.5 s later when one is not "
                                  "acknowledged) are its proof of life. Pauses of the scheduler process itself do "
                                  "not count. More than two pulse intervals")
    heartbeat_interval_ms: int = Field(300_000, ge=50, le=3_600_000, description="agents send a beat at once on "
                                       "a change (GPU health, running workers) and this often when nothing changes "
                                       "(a safety net only: pulses prove liveness, and each refresh costs the "
                                       "leader a TLS handshake per node, as agents hold no connection between "
                                       "beats); an open stream without pulses (an older agent) silent for 3 "
                                       "intervals counts as a lost node")
    leader_grace_s: float = Field(10.0, ge=0, description="a new leader counts every registered node alive this "
                                  "long (at least node_timeout_s) while the agents find it, and longer while agents "
                                  "keep registering (until none arrived, or even called, for node_timeout_s), many of "
                                  "them are silent together (the storm still going on), or its end would lose more "
                                  "than a tenth of the registered nodes at once; 60 s at most. Agents "
                                  "notice a leader change when their pulses go unacknowledged for 4 s, so keep it "
                                  "above that plus a few seconds of reconnecting")
    register_concurrency: int = Field(32, ge=1, le=4096, description="agent registrations the leader handles at "
                                      "once; during a failover every agent registers at once, and those beyond "
                                      "wait for a slot while the wait is short (register_max_wait_s)")
    register_max_wait_s: float = Field(2.0, gt=0, le=60, description="an agent's registration that would wait "
                                       "longer than this for a slot (estimated from the recent registration rate) "
                                       "is refused at once, UNAVAILABLE with the time to come back, which the "
                                       "agent waits: a failover's storm is spread over the time the leader needs "
                                       "for it instead of being retried into collapse. Keep it well below the "
                                       "agents' 5 s registration deadline")
    worker_fence_s: float = Field(8.0, ge=0, le=3600, description="agents renew a lease this long with every "
                                  "answer of the leader; when it runs out their workers are killed. A lost "
                                  "node's gang is released this long (+1 s) after its last heartbeat, so no old "
                                  "attempt still runs when the job starts again. Must cover a failover. 0: off")
    max_infra_restarts: int = Field(20, ge=0, le=10_000, description="restarts after infrastructure failures (node "
                                    "lost, GPU unhealthy) per job before it fails; they do not use max_restarts")
    reconcile_interval_s: float = Field(1.0, gt=0)
    reconcile_pace_us_per_pending_job: float = Field(
        PACE_S_PER_PENDING_JOB * 1e6, ge=0, le=10_000, description="after a reconcile cycle whose placement "
        "looked at P pending jobs, the next starts no sooner than P x this (at most reconcile_interval_s, never "
        "past a node's deadline): a backlog of 2,000 jobs is walked at most every 0.1 s and a queue of 20 every "
        "1 ms, so a burst of submits over a backlog does not spend the leader's CPU on walking the queue after "
        "each one (the changes of the rest are taken together by the next cycle). 0: cycles back to back")
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM → SIGKILL grace when stopping workers")
    master_port_range: str = Field("29500-29999", description="MASTER_PORT range for rank-0 rendezvous")
    leader_ttl_s: int = Field(3, ge=1, le=60, description="leader lease TTL; bounds failover time")
    agent_call_timeout_s: float = Field(10.0, gt=0)
    checkpoint_store_address: str = Field("", description="host:port of the checkpoint-store, given to every "
                                          "worker as TRAINYARD_CHECKPOINT_STORE; empty: none")
    job_issuer_cert_file: str = Field("", description="the job issuer's certificate (an intermediate CA, "
                                      "`make certs` writes deploy/pki/job-issuer.pem): each launched attempt gets "
                                      "a trainyard://job/<id> credential for the checkpoint-store signed with it; "
                                      "empty: none, and workers cannot reach a checkpoint-store on mTLS")
    job_issuer_key_file: str = Field("", description="the job issuer's private key (PEM, unencrypted; keep it 0600)")
    job_credential_ttl_s: int = Field(3600, ge=600, le=7 * 86400,
                                      description="how long a job attempt's checkpoint-store credential is valid "
                                      "(600 s to 7 days, the checkpoint-store's default gc_tombstone_retention_s, "
                                      "which must not be shorter); the leader renews a running attempt's past half "
                                      "of that, so it bounds how long a leaked one is good for, not how long an "
                                      "attempt may run")
    # --- history (docs/operations.md, "Job history"): finished jobs leave etcd for a SQL database ---
    history_url: SecretStr | None = Field(
        None, description="SQLAlchemy URL of the history store: postgresql+asyncpg://user:password@host/db in "
        "production, sqlite+aiosqlite:////var/lib/trainyard/history.db on one machine. The leader writes each "
        "finished job and its usage records there and removes the job from etcd job_ttl_s later; reads of "
        "finished jobs come from it. Unset: finished jobs stay in etcd for good (the scheduler warns at start). "
        "A secret: never logged")
    job_ttl_s: float = Field(3600.0, ge=0, le=30 * 86400, description="how long a finished job stays in etcd "
                             "after it ended, once it is in the history store (watchers and the gateway see its "
                             "end there meanwhile)")
    history_job_retention_days: int = Field(0, description="how long a finished job stays in the history store "
                                            "after it ended: its record and labels, read by GetJob and ListJobs. "
                                            "0 (the default): kept forever. Else at least 1; the leader prunes "
                                            "older jobs hourly. Their usage records stay, by "
                                            "history_usage_retention_days")
    history_usage_retention_days: int = Field(0, description="how long a usage record (accounting: one per "
                                              "allocation) stays in the history store after the allocation ended, "
                                              "whether or not its job is still there. 0 (the default): kept "
                                              "forever. Else at least 1; pruned hourly by the leader")
    idempotency_ttl_s: float = Field(86400.0, ge=60, le=30 * 86400, description="a submit's idempotency key "
                                     "answers retries of that submit this long at least (and up to an hour more); "
                                     "then it leaves etcd and the key may name a new job")
    # --- placement policy (queues and team quotas live in etcd, set through the gateway's admin API) ---
    speed_factors: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_SPEED_FACTORS),
        description="Relative training throughput per GPU of each accelerator model (A100 = 1.0); the scheduler "
                    "runs a job on the fastest model it accepts that has room. Unknown models count as 1.0")
    priority_classes: dict[str, PriorityClassSettings] = Field(
        default_factory=lambda: {c.name: PriorityClassSettings(value=c.value, preemptible=c.preemptible,
                                                               can_preempt=c.can_preempt) for c in DEFAULT_CLASSES},
        description="Priority classes by name: value (higher first), preemptible, can_preempt")
    default_priority_class: str = Field(DEFAULT_CLASS, description="Class of jobs that name none")
    fair_share_half_life_s: float = Field(3600.0, gt=0, le=90 * 86400,
                                          description="Half-life of the usage history that fair share orders teams by")
    reservation_depth: int = Field(1, ge=0, le=100, description="How many blocked jobs (highest standing first) "
                                   "hold a reservation that backfill must not delay; 0 turns backfill protection off")
    preemption: bool = Field(True, description="Let jobs preempt lower-standing or borrowed gangs")
    preempt_exempt_s: float = Field(300.0, ge=0, le=7 * 86400,
                                    description="A gang runs at least this long before it may be preempted, doubled "
                                                "for each earlier preemption of its job (capped at 64x)")
    placement_order: Literal["fair-share", "fifo"] = Field(
        "fair-share", description="Order of jobs of equal standing: team fair share, or submission time")
    tool_teams: list[str] = Field(
        default_factory=list, description="the teams an internal tool (certificate trainyard://tool/<name>) may "
        "submit, read and cancel jobs for, as TOOL:TEAM pairs (e.g. ci:ml,ci:research); a tool with no pair acts "
        "for no team. The gateway acts for its users' teams")

    # --- usage and cost (docs/operations.md, "Usage and cost"): GET /v1/usage, the UsageService ---
    usage_prices: dict[str, float] = Field(
        default_factory=dict, description="Price of one GPU-hour per accelerator model, as the agents report "
        "models (e.g. H100-80GB-HBM3=2.49), in usage_currency; a mixed gang by its models joined by '+'. A model "
        "without a price costs 0 in usage reports, which name it as unpriced. Prices are >= 0")
    usage_currency: str = Field("USD", description="The currency of usage_prices and of the costs in usage "
                                "reports: an ISO 4217 code (3 upper-case letters)")

    @field_validator("tool_teams")
    @classmethod
    def _tool_teams(cls, v: list[str]) -> list[str]:
        identity.tool_team_bindings(v)  # the checkpoint-store reads the same setting the same way
        return v

    def tool_team_map(self) -> dict[str, frozenset[str]]:
        return identity.tool_team_bindings(self.tool_teams)

    @field_validator("history_url")
    @classmethod
    def _check_history_url(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None or not v.get_secret_value():
            return None
        from .history.urls import check_url  # SQLAlchemy loads only when history is used

        check_url(v.get_secret_value())
        return v

    @field_validator("history_job_retention_days", "history_usage_retention_days")
    @classmethod
    def _retention_days(cls, v: int, info: ValidationInfo) -> int:
        if not 0 <= v <= MAX_HISTORY_RETENTION_DAYS:
            raise ValueError(f"{info.field_name} must be 0 (keep forever) or a number of days from 1 to "
                             f"{MAX_HISTORY_RETENTION_DAYS}, not {v}")
        return v

    def history(self) -> str:
        """The history store's URL ("" none). Pass it on, never log it."""
        return self.history_url.get_secret_value() if self.history_url is not None else ""

    @model_validator(mode="after")
    def _job_issuer(self) -> SchedulerSettings:
        if bool(self.job_issuer_cert_file) != bool(self.job_issuer_key_file):
            raise ValueError("job_issuer_cert_file and job_issuer_key_file go together: set both or neither")
        if self.job_issuer_cert_file and not self.tls_ca_file:
            raise ValueError("job_issuer_cert_file needs the mTLS files (tls_ca_file is the CA bundle workers "
                             "verify the checkpoint-store against)")
        return self

    @model_validator(mode="after")
    def _usage_pricing(self) -> SchedulerSettings:
        self.pricing()  # ValueError naming the bad price or currency
        return self

    def pricing(self) -> Pricing:
        return Pricing.of(self.usage_prices, self.usage_currency)

    @field_validator("speed_factors")
    @classmethod
    def _speeds(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, x in v.items() if not 0 < x <= 1000 or not k]
        if bad:
            raise ValueError(f"speed factors must be > 0 and <= 1000 for non-empty model names: {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _classes(self) -> SchedulerSettings:
        try:
            validate_classes(self.policy_classes(), self.default_priority_class)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        return self

    def policy_classes(self) -> list[PriorityClass]:
        return [PriorityClass(name, c.value, c.preemptible, c.can_preempt) for name, c in self.priority_classes.items()]

    def policy(self) -> PolicyConfig:
        return PolicyConfig(classes={c.name: c for c in self.policy_classes()},
                            default_class=self.default_priority_class, speed_factors=dict(self.speed_factors),
                            fair_share_half_life_s=self.fair_share_half_life_s,
                            reservation_depth=self.reservation_depth, preemption=self.preemption,
                            preempt_exempt_s=self.preempt_exempt_s)

    @field_validator("master_port_range")
    @classmethod
    def _port_range(cls, v: str) -> str:
        lo, sep, hi = v.partition("-")
        if not sep or not lo.isdigit() or not hi.isdigit() or not 1024 <= int(lo) <= int(hi) <= 65535:
            raise ValueError("must look like LOW-HIGH with 1024 <= LOW <= HIGH <= 65535")
        return v

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> SchedulerSettings:
        if self.worker_fence_s and self.worker_fence_s < self.node_timeout_s + self.leader_ttl_s:
            raise ValueError(f"worker_fence_s ({self.worker_fence_s}) must be at least node_timeout_s + "
                             f"leader_ttl_s ({self.node_timeout_s + self.leader_ttl_s:g}): a scheduler failover "
                             "would otherwise kill every worker")
        if self.node_timeout_s <= 2 * PULSE_INTERVAL_S:
            raise ValueError(f"node_timeout_s ({self.node_timeout_s}) must be more than two liveness pulse intervals "
                             f"({2 * PULSE_INTERVAL_S:g}s): with less, one pulse and its retry lost on the network "
                             "would be a lost node")
        return self

    @property
    def stale_stream_s(self) -> float:
        """An open heartbeat stream without a beat this long means the agent no longer runs its loop."""
        return 3 * self.heartbeat_interval_ms / 1000

    @property
    def port_range(self) -> tuple[int, int]:
        lo, _, hi = self.master_port_range.partition("-")
        return int(lo), int(hi)

    def principal(self) -> Principal:
        """Every replica holds a scheduler certificate: agents accept launches and epochs only from it."""
        return identity.SCHEDULER
