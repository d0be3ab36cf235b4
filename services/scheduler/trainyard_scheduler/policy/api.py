"""Extension points of placement. A plugin implements only the points it needs.

- Filter: may this job's share go on this node at all? Returns None when yes, else a short reason
  (reasons are aggregated into the job's "why pending" message).
- Score: among the nodes that pass, higher is better. Weighted sum over the profile's scorers.

Plugins are pure and stateless across calls: `place` may call them in any order, many times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..domain.models import Job, Node


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node as placement sees it in the current decision: free healthy GPU indices included."""

    node: Node
    free_gpus: tuple[int, ...]
    alive: bool
    # The node still runs workers no allocation accounts for; they are being stopped.
    has_orphans: bool = False


class FilterPlugin(Protocol):
    name: str

    def filter(self, job: Job, view: NodeView) -> str | None: ...


class ScorePlugin(Protocol):
    name: str

    def score(self, job: Job, view: NodeView) -> float: ...


@dataclass(frozen=True)
class Profile:
    """The plugins one scheduler runs, in order, and the weight of each scorer."""

    filters: tuple[FilterPlugin, ...]
    scorers: tuple[tuple[ScorePlugin, float], ...]
