"""Maps plugin names to factories; the scheduler's settings pick a profile by name per point."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainyard_core.errors import InvalidArgument

from .api import Profile
from .plugins.accelerators import AcceleratorRequest, SpeedFactor
from .plugins.fairshare import FairShare, Fifo
from .plugins.nodes import BestFit, CpuFit, NodeReady, QueuePartition
from .plugins.quota import QueueCap, TeamQuota
from .plugins.victims import LeastLostWork

GATES: dict[str, Callable[[], Any]] = {NodeReady.name: NodeReady}
MODEL_FILTERS: dict[str, Callable[[], Any]] = {AcceleratorRequest.name: AcceleratorRequest}
MODEL_SCORES: dict[str, Callable[[], Any]] = {SpeedFactor.name: SpeedFactor}
NODE_FILTERS: dict[str, Callable[[], Any]] = {QueuePartition.name: QueuePartition, CpuFit.name: CpuFit}
NODE_SCORES: dict[str, Callable[[], Any]] = {BestFit.name: BestFit}
ADMISSIONS: dict[str, Callable[[], Any]] = {TeamQuota.name: TeamQuota, QueueCap.name: QueueCap}
ORDERS: dict[str, Callable[[], Any]] = {FairShare.name: FairShare, Fifo.name: Fifo}
VICTIM_COSTS: dict[str, Callable[[], Any]] = {LeastLostWork.name: LeastLostWork}


@dataclass(frozen=True)
class ProfileSpec:
    gates: tuple[str, ...] = (NodeReady.name,)
    model_filters: tuple[str, ...] = (AcceleratorRequest.name,)
    model_score: str = SpeedFactor.name
    node_filters: tuple[str, ...] = (QueuePartition.name, CpuFit.name)
    node_score: str = BestFit.name
    admissions: tuple[str, ...] = (TeamQuota.name, QueueCap.name)
    order: str = FairShare.name
    victim_cost: str = LeastLostWork.name


def _pick(point: str, table: Mapping[str, Callable[[], Any]], names: Sequence[str]) -> list[Any]:
    unknown = [n for n in names if n not in table]
    if unknown:
        raise InvalidArgument(f"unknown {point} plugin(s): {', '.join(unknown)}; known: {', '.join(table)}")
    return [table[n]() for n in names]


def build_profile(spec: ProfileSpec = ProfileSpec()) -> Profile:
    return Profile(
        gates=tuple(_pick("node gate", GATES, spec.gates)),
        model_filters=tuple(_pick("model filter", MODEL_FILTERS, spec.model_filters)),
        model_score=_pick("model score", MODEL_SCORES, [spec.model_score])[0],
        node_filters=tuple(_pick("node filter", NODE_FILTERS, spec.node_filters)),
        node_score=_pick("node score", NODE_SCORES, [spec.node_score])[0],
        admissions=tuple(_pick("admission", ADMISSIONS, spec.admissions)),
        order=_pick("queue order", ORDERS, [spec.order])[0],
        victim_cost=_pick("victim cost", VICTIM_COSTS, [spec.victim_cost])[0],
    )
