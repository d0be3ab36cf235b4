"""etcd key layout of the scheduler (every key under the configured prefix, default /trainyard):

    {p}/jobs/{job_id}                  Job record (JSON). Job ids sort by submission time.
    {p}/allocations/{job_id}           The one allocation record of a placed gang (JSON).
    {p}/nodes/{node_id}                Node inventory, labels, cordon (JSON), written at registration.
    {p}/idempotency/{team}/{key}       job id of a submit made with an idempotency key.
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

    def job(self, job_id: str) -> str:
        return self.jobs + job_id

    def allocation(self, job_id: str) -> str:
        return self.allocations + job_id

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def idempotency(self, team: str, key: str) -> str:
        return f"{self.prefix}/idempotency/{team}/{key}"
