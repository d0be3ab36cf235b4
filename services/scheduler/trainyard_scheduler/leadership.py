"""Whether this replica leads now, for the servicers that only the leader may serve.

`epoch` is set by the leadership loop (app.py) for the term this replica leads, 0 otherwise. `leader` names
the replica that leads as the election last saw it ('' while nobody does or it is not known yet); the
campaign keeps it fresh on every round (`observe`), so a standby's refusal names the leader of now, not the
one of when it started waiting.
"""

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

    def observe(self, leader: str) -> None:
        """The election saw `leader` lead ('' for nobody)."""
        self.leader = leader

    def step_down(self) -> None:
        """The term ended: refuse leader calls from now on. Who leads next is not known until the
        campaign's next round says."""
        self.epoch = 0
        self.leader = ""

    def require(self) -> int:
        if not self.epoch:
            where = f"; the leader is {self.leader}" if self.leader else "; no leader is known yet, retry shortly"
            raise NotLeader(f"this scheduler replica ({self.identity}) is not the leader{where}", self.leader)
        return self.epoch
