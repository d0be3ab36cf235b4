"""The current health of every accelerator on this node, with a version for "what changed since".

Transitions (issue 2): HEALTHY → DEGRADED → UNHEALTHY, worst wins: a milder fault never hides a worse
one, and nothing heals by itself (an operator marking a GPU healthy again comes with issue 3). Every
change bumps `version` and wakes `changes` waiters, so the reporter pushes it at once instead of at the
next heartbeat tick. Only the event loop mutates the book (the monitor hands its thread's results back to
the loop first).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..model import Accelerator, Health
from ..notify import Notifier

log = logging.getLogger(__name__)


class HealthBook:
    def __init__(self, accelerators: Sequence[Accelerator]) -> None:
        self._gpus: list[Accelerator] = list(accelerators)
        self._changed_at: list[int] = [0] * len(self._gpus)
        self.version = 0
        self.changes = Notifier()

    def __len__(self) -> int:
        return len(self._gpus)

    def all(self) -> tuple[Accelerator, ...]:
        return tuple(self._gpus)

    def get(self, index: int) -> Accelerator:
        return self._gpus[index]

    def report(self, index: int, health: Health, reason: str) -> bool:
        """Record a finding about GPU `index`; True when its state got worse (and was published)."""
        current = self._gpus[index]
        if health <= current.health:
            return False
        self._gpus[index] = current.with_health(health, reason)
        self.version += 1
        self._changed_at[index] = self.version
        log.warning("GPU health changed", extra={"gpu": index, "health": health.name, "reason": reason,
                                                 "previous": current.health.name})
        self.changes.notify()
        return True

    def changed_since(self, version: int) -> list[Accelerator]:
        return [g for g, at in zip(self._gpus, self._changed_at, strict=True) if at > version]
