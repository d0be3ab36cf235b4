"""Fencing of stale scheduler leaders.

Every leader of the scheduler has an epoch that grows with each election. The agent remembers the
highest epoch it has seen (in launch requests and in the scheduler's register and heartbeat answers) and
refuses launches stamped with a lower one: a deposed leader that has not noticed yet cannot start
workers on GPUs the new leader may have given to someone else. The epoch is kept in memory only, so an
etcd wiped for a fresh development cluster does not lock agents out; the new leader's first heartbeat
answer raises the fence again after an agent restart.
"""

from __future__ import annotations

import logging

from trainyard_core.errors import FailedPrecondition

log = logging.getLogger(__name__)


class LeaderFence:
    def __init__(self) -> None:
        self.highest = 0

    def observe(self, epoch: int) -> None:
        if epoch > self.highest:
            if self.highest:
                log.info("new scheduler leader epoch", extra={"epoch": epoch, "previous": self.highest})
            self.highest = epoch

    def check(self, epoch: int) -> None:
        """Raise FailedPrecondition for a request from an older leader; remember a newer epoch."""
        if epoch < self.highest:
            raise FailedPrecondition(f"stale scheduler leader: request has leader epoch {epoch}, but this "
                                     f"agent has seen epoch {self.highest}")
        self.observe(epoch)
