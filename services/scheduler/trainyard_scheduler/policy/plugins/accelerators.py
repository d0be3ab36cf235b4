"""Heterogeneous accelerators: which models a job accepts, and how fast each would run it."""

from __future__ import annotations

from ...domain.models import Job
from ...domain.queues import PolicyConfig
from ..api import ModelInfo


def parse_cc(cc: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in cc.split(".")) if cc else ()
    except ValueError:
        return ()


class AcceleratorRequest:
    """Exact model, any-of list, or a class (vendor, minimum memory, minimum compute capability)."""

    name = "accelerator-request"

    def filter(self, job: Job, model: ModelInfo) -> str | None:
        r = job.spec.resources
        if r.accelerator and model.model != r.accelerator:
            return f"not {r.accelerator}"
        if r.accelerators and model.model not in r.accelerators:
            return f"not one of {', '.join(r.accelerators)}"
        if r.vendor and model.vendor.lower() != r.vendor.lower():
            return f"vendor {model.vendor}, not {r.vendor}"
        if r.min_memory_gb and model.memory_mb < r.min_memory_gb * 1000:
            return f"{model.memory_mb // 1024} GB < {r.min_memory_gb} GB"
        if r.min_compute_capability:
            have = parse_cc(model.compute_capability)
            if not have or have < parse_cc(r.min_compute_capability):
                return f"compute capability {model.compute_capability or 'unknown'} < {r.min_compute_capability}"
        return None


class SpeedFactor:
    """Expected throughput per GPU: the job's own hint for the model, else the configured factor."""

    name = "speed-factor"

    def score(self, job: Job, model: ModelInfo, config: PolicyConfig) -> float:
        return config.speed(model.model, job.spec.resources.speed_hints)
