"""Whether this replica leads now, for the servicers that only the leader may serve."""

from __future__ import annotations

from trainyard_core.errors import NotLeader


class Leadership:
    def __init__(self, identity: str) -> None:
        self.identity = identity
        self.epoch = 0
        self.leader = ""

    @property
    def is_leader(self) -> bool:
        return self.epoch > 0

    def require(self) -> int:
        if not self.epoch:
            where = f"; the leader is {self.leader}" if self.leader else ""
            raise NotLeader(f"this scheduler replica ({self.identity}) is not the leader{where}", self.leader)
        return self.epoch
