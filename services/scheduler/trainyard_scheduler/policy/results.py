"""What a placement session decides: the result types of `place.place` (re-exported by place.py, which
is where callers import them from).

Separate from place.py so that the parts of a session that live in their own modules (reserve.py,
preempt.py, pernode.py) can build decisions, reservations and preemptions without importing the session's
module, which imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..domain.models import NodeAssignment
from .topology import NODE


@dataclass(frozen=True, slots=True)
class Decision:
    job_id: str
    assignments: tuple[NodeAssignment, ...]
    master_port: int
    model: str = ""
    borrowed: bool = False
    tier: int = NODE


@dataclass(frozen=True, slots=True)
class Preemption:
    preemptor: str
    victims: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Reservation:
    job_id: str
    start: float  # math.inf when some gang it waits for has no time limit
    nodes: tuple[str, ...]
    model: str


@dataclass(frozen=True, slots=True)
class Unplaced:
    job_id: str
    reason: str


@dataclass
class PlacementResult:
    decisions: list[Decision] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    unplaced: list[Unplaced] = field(default_factory=list)
    # Every job the session considered, in the order it did (the queue order: domain/pending.py).
    considered: list[str] = field(default_factory=list)
    # (job id, seconds) per job considered, when a timer was passed (benchmarks).
    timings: list[tuple[str, float]] = field(default_factory=list)
