"""Maps plugin names to factories; a profile in the settings picks them by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trainyard_core.errors import InvalidArgument

from .api import FilterPlugin, Profile, ScorePlugin
from .plugins.binpack import BestFit
from .plugins.fit import AcceleratorFit, GpuCountFit, NodeReady

FILTERS: dict[str, Callable[[], FilterPlugin]] = {
    NodeReady.name: NodeReady,
    AcceleratorFit.name: AcceleratorFit,
    GpuCountFit.name: GpuCountFit,
}
SCORERS: dict[str, Callable[[], ScorePlugin]] = {
    BestFit.name: BestFit,
}

DEFAULT_FILTERS = (NodeReady.name, AcceleratorFit.name, GpuCountFit.name)
DEFAULT_SCORERS = ((BestFit.name, 1.0),)


def build_profile(filters: Sequence[str] = DEFAULT_FILTERS,
                  scorers: Sequence[tuple[str, float]] = DEFAULT_SCORERS) -> Profile:
    unknown = [n for n in filters if n not in FILTERS] + [n for n, _ in scorers if n not in SCORERS]
    if unknown:
        raise InvalidArgument(f"unknown placement plugin(s): {', '.join(unknown)}; known filters: "
                              f"{', '.join(FILTERS)}; known scorers: {', '.join(SCORERS)}")
    return Profile(filters=tuple(FILTERS[n]() for n in filters),
                   scorers=tuple((SCORERS[n](), w) for n, w in scorers))
