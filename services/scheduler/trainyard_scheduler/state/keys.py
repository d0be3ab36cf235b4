"""etcd key layout of the scheduler (every key under the configured prefix, default /trainyard):

    {p}/jobs/{job_id}                  Job record (JSON). Job ids sort by submission time.
    {p}/allocations/{job_id}           The one allocation record of a placed gang (JSON).
    {p}/nodes/{node_id}                Node inventory, labels, cordon (JSON), written at registration.
    {p}/holdings/{node_id}             GPUs each job holds on the node (JSON), written only together with the
                                       allocations that take or give them back (state/holdings.py): the
                                       store-side guard that no GPU is in two gangs.
    {p}/idempotency/{team}/{key}       job id of a submit made with an idempotency key.
    {p}/queues/{name}                  Queue: tier, partition labels, GPU cap (JSON; admin API).
    {p}/quotas/{team}                  Team quota per accelerator model and fair-share weight (admin API).
    {p}/usage                          Decayed fair-share usage per team and model; rewritten by the leader.
    {p}/checkpoints-latest/{job_id}    Written by the checkpoint-store; read for a job's last checkpoint
                                       time (what preempting it would lose).
    {p}/election/scheduler             Leader key, bound to the leader's lease. Its create revision is
                                       the leader's epoch; every leader write compares it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "/trainyard"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}/jobs/"

    @property
    def allocations(self) -> str:
        return f"{self.prefix}/allocations/"

    @property
    def nodes(self) -> str:
        return f"{self.prefix}/nodes/"

    @property
    def leader(self) -> str:
        return f"{self.prefix}/election/scheduler"

    @property
    def queues(self) -> str:
        return f"{self.prefix}/queues/"

    @property
    def quotas(self) -> str:
        return f"{self.prefix}/quotas/"

    @property
    def usage(self) -> str:
        return f"{self.prefix}/usage"

    @property
    def checkpoints_latest(self) -> str:
        return f"{self.prefix}/checkpoints-latest/"

    @property
    def checkpoints(self) -> str:
        return f"{self.prefix}/checkpoints/"

    @property
    def mirrored(self) -> tuple[str, ...]:
        """What every replica keeps a copy of (the reconcile loop's snapshot, the archiver, the node list):
        live records only. The idempotency keys, the checkpoint-store's records, the gateway's tokens and the
        audit log share the prefix and are read from etcd when needed, never copied."""
        return (self.jobs, self.allocations, self.nodes, self.all_holdings, self.queues, self.quotas, self.usage,
                self.checkpoints_latest)

    def queue(self, name: str) -> str:
        return self.queues + name

    def quota(self, team: str) -> str:
        return self.quotas + team

    def job(self, job_id: str) -> str:
        return self.jobs + job_id

    def allocation(self, job_id: str) -> str:
        return self.allocations + job_id

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def all_holdings(self) -> str:
        return f"{self.prefix}/holdings/"

    def holdings(self, node_id: str) -> str:
        return self.all_holdings + node_id

    def idempotency(self, team: str, key: str) -> str:
        return f"{self.prefix}/idempotency/{team}/{key}"
