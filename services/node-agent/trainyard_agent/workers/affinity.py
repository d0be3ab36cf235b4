"""NUMA-aware CPU binding of workers: which CPUs a worker runs on, from the CPU affinity of its GPUs.

A worker feeding a GPU from CPUs of another NUMA node pays for every host-to-device copy and every
dataloader page across the socket interconnect. The topology (NVML's CPU affinity of each GPU) says
which CPUs are close; a worker is bound to the union of its GPUs' CPUs, intersected with the CPUs this
agent may use (a cpuset or container limit can exclude some, and a simulated profile names CPUs this
machine does not have). Nothing is bound when that leaves no CPU, when a GPU's affinity is unknown, or
for a worker without GPUs: an unbound worker is slower at worst, a wrongly bound one starves.

Pure functions; the supervisor passes the agent's own CPUs in.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Binding:
    """The CPUs to bind a worker to; empty with the `reason` it is not bound."""

    cpus: frozenset[int]
    reason: str = ""


def check_gpu_cpus(gpu_cpus: Mapping[int, Iterable[int]]) -> dict[int, frozenset[int]]:
    """GPU index → its CPUs, validated; ValueError naming the bad entry."""
    checked: dict[int, frozenset[int]] = {}
    for gpu, cpus in gpu_cpus.items():
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise ValueError(f"gpu_cpus: GPU index {gpu!r} must be an integer >= 0")
        cpu_list = list(cpus)
        bad = [c for c in cpu_list if isinstance(c, bool) or not isinstance(c, int) or c < 0]
        if bad:
            raise ValueError(f"gpu_cpus: CPU {bad[0]!r} of GPU {gpu} must be an integer >= 0")
        checked[gpu] = frozenset(cpu_list)
    return checked


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (empty where the OS cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


def worker_binding(gpu_cpus: Mapping[int, frozenset[int]], gpu_indices: Iterable[int],
                   available: frozenset[int]) -> Binding:
    gpus = sorted(gpu_indices)
    if not gpus:
        return Binding(frozenset(), "the worker has no GPUs")
    unknown = [g for g in gpus if not gpu_cpus.get(g)]
    if unknown:
        return Binding(frozenset(), f"the CPU affinity of GPU {format_list(unknown)} is not known")
    wanted = frozenset().union(*(gpu_cpus[g] for g in gpus))
    usable = wanted & available
    if not usable:
        return Binding(frozenset(), f"none of the CPUs {format_cpus(wanted)} near GPU {format_list(gpus)} "
                                    f"is available to the agent (it may use {format_cpus(available) or 'none'})")
    return Binding(usable)


def format_cpus(cpus: Iterable[int]) -> str:
    """'0-3,8,10-11': the cpuset list format the kernel and taskset use."""
    ordered = sorted(cpus)
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def format_list(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)
