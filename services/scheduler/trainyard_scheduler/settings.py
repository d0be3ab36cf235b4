"""Settings of the scheduler (flags, TRAINYARD_SCHEDULER_* environment, optional YAML/JSON file)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from trainyard_core.settings import BaseSettings


class SchedulerSettings(BaseSettings):
    """Trainyard scheduler: gang placement of jobs on GPU nodes, backed by etcd."""

    listen_host: str = "127.0.0.1"
    listen_port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_address: str = Field("", description="host:port other components use to reach this replica")
    node_timeout_s: float = Field(5.0, gt=0, description="a node without heartbeat this long is lost")
    heartbeat_interval_ms: int = Field(1000, ge=50, le=60_000)
    reconcile_interval_s: float = Field(1.0, gt=0)
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM → SIGKILL grace when stopping workers")
    master_port_range: str = Field("29500-29999", description="MASTER_PORT range for rank-0 rendezvous")
    leader_ttl_s: int = Field(3, ge=1, le=60, description="leader lease TTL; bounds failover time")
    agent_call_timeout_s: float = Field(10.0, gt=0)

    @field_validator("master_port_range")
    @classmethod
    def _port_range(cls, v: str) -> str:
        lo, sep, hi = v.partition("-")
        if not sep or not lo.isdigit() or not hi.isdigit() or not 1024 <= int(lo) <= int(hi) <= 65535:
            raise ValueError("must look like LOW-HIGH with 1024 <= LOW <= HIGH <= 65535")
        return v

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> SchedulerSettings:
        # Agents heartbeat at the interval the scheduler hands them; a timeout shorter than a few
        # intervals would declare healthy nodes lost between two beats.
        if self.node_timeout_s * 1000 < 3 * self.heartbeat_interval_ms:
            raise ValueError(f"node_timeout_s ({self.node_timeout_s}) must be at least 3 heartbeat intervals "
                             f"({3 * self.heartbeat_interval_ms / 1000:g}s with heartbeat_interval_ms="
                             f"{self.heartbeat_interval_ms})")
        return self

    @property
    def port_range(self) -> tuple[int, int]:
        lo, _, hi = self.master_port_range.partition("-")
        return int(lo), int(hi)
