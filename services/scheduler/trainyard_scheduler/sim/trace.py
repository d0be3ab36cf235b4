"""Synthetic job traces: what users submit, and the ground truth the scheduler does not see.

Each `TraceJob` carries the `JobSpec` the scheduler gets (resources, accelerator request, class,
topology request, time limit, speed hints for some jobs) and the truth the simulator runs it by: its
work in GPU-seconds at speed 1.0 (an A100 by convention) and its true per-GPU speed on each model. True
speeds are the configured speed factors perturbed per job (jobs differ in character: one is memory-bound,
another compute-bound), so speed factors are a good guess, not an oracle; jobs that carry `speed_hints`
tell the scheduler their true speeds.

Shape of the default trace (every figure is a parameter):
- Poisson arrivals at the rate that offers `load` x the fleet's throughput (speed-factor units).
- Sizes heavy-tailed: mostly 1-8 GPUs, a tail of 64-1,024. Above 8 GPUs a job takes whole nodes (8 per node).
- Run time at speed 1.0 lognormal around `median_runtime_s`, longer for bigger jobs; `work` = GPUs x that run time.
- Accelerators: 70% any model, 15% any-of two models, 5% one exact model, 10% a class (vendor NVIDIA,
  or at least 128 GB of memory).
- Classes: 10% high, 75% normal, 15% low. Multi-node jobs ask for a topology tier now and then (leaf for
  gangs that fit one, spine above), some of them as a hard requirement (only when an empty fleet holds it).
- Time limit: what users give, 1.2-3x the true run time on the slowest model the job accepts.
- Checkpoints every 15-30 minutes of run time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..domain.models import Job, JobSpec, JobState, Resources, TopologyRequest
from ..settings import DEFAULT_SPEED_FACTORS
from .fleet import MODELS, FleetShape

T = TypeVar("T")

DEFAULT_SIZES: tuple[tuple[int, float], ...] = (
    (1, 0.30), (2, 0.10), (4, 0.12), (8, 0.20), (16, 0.06), (32, 0.06), (64, 0.06), (128, 0.04),
    (256, 0.03), (512, 0.02), (1024, 0.01))
DEFAULT_TEAMS: tuple[str, ...] = ("team-a", "team-b", "team-c", "team-d")
DEFAULT_CLASSES: tuple[tuple[str, float], ...] = (("high", 0.10), ("", 0.75), ("low", 0.15))


@dataclass(frozen=True, slots=True)
class TraceJob:
    job_id: str
    submit: float
    team: str
    spec: JobSpec
    # Work in GPU-seconds at speed 1.0; true per-GPU speed of this job on each model (absent: 1.0).
    work: float
    speeds: Mapping[str, float] = field(default_factory=dict)
    # Progress is saved every `checkpoint_s` of run time (0: never).
    checkpoint_s: float = 1800.0

    @property
    def gpus(self) -> int:
        return self.spec.resources.total_gpus

    def speed(self, model: str) -> float:
        return self.speeds.get(model, 1.0)

    def job(self) -> Job:
        """The job as submitted: PENDING, queued at its submission time."""
        return Job(id=self.job_id, spec=self.spec, state=JobState.PENDING, team=self.team, user=self.team,
                   created_at=self.submit, updated_at=self.submit, queued_at=self.submit)


def trace_job(job_id: str, submit: float, *, nodes: int = 1, gpus_per_node: int = 8, work: float = 3600.0,
              speeds: Mapping[str, float] | None = None, team: str = "team-a", priority_class: str = "",
              priority: int = 0, time_limit_s: float = 0.0, checkpoint_s: float = 1800.0, accelerator: str = "",
              accelerators: Sequence[str] = (), tier: str = "", required: bool = False, wait_s: float = 0.0,
              speed_hints: Mapping[str, float] | None = None) -> TraceJob:
    """One hand-made trace job (tests build scenarios from these)."""
    res = Resources(nodes=nodes, gpus_per_node=gpus_per_node, accelerator=accelerator,
                    accelerators=tuple(accelerators), speed_hints=dict(speed_hints or {}))
    spec = JobSpec(name=job_id, command=("python", "train.py"), resources=res, priority=priority,
                   priority_class=priority_class, time_limit_s=time_limit_s,
                   topology=TopologyRequest(tier=tier, required=required, wait_s=wait_s))
    return TraceJob(job_id, submit, team, spec, work, dict(speeds or {}), checkpoint_s)


def _pick(rng: random.Random, table: Sequence[tuple[T, float]]) -> T:
    return rng.choices([v for v, _ in table], weights=[w for _, w in table])[0]


def fleet_capacity(shape: FleetShape, speed_factors: Mapping[str, float]) -> float:
    """Throughput of a fleet of this shape in speed-1.0 GPUs (the model mix weighted by speed factors)."""
    total = sum(w for _, w in shape.mix)
    per_gpu = sum(w * speed_factors.get(m, 1.0) for m, w in shape.mix) / total
    return shape.nodes * shape.gpus_per_node * per_gpu


def synthetic_trace(jobs: int, seed: int, *, teams: Sequence[str] = DEFAULT_TEAMS, load: float = 0.9,
                    shape: FleetShape | None = None, sizes: Sequence[tuple[int, float]] = DEFAULT_SIZES,
                    classes: Sequence[tuple[str, float]] = DEFAULT_CLASSES,
                    speed_factors: Mapping[str, float] | None = None, median_runtime_s: float = 3600.0,
                    runtime_sigma: float = 1.0, speed_spread: float = 0.2, hint_share: float = 0.2,
                    any_of_share: float = 0.15, exact_share: float = 0.05, class_share: float = 0.10,
                    topology_share: float = 0.6, checkpoint_every_s: Sequence[float] = (900.0, 1200.0, 1800.0),
                    arrival_rate: float = 0.0, start: float = 0.0) -> list[TraceJob]:
    """`jobs` jobs in submission order, deterministic for a seed. `load`: offered work as a share of the
    fleet's throughput (ignored when `arrival_rate`, in jobs per second, is given)."""
    rng = random.Random(seed)
    shape = shape or FleetShape()
    factors = dict(speed_factors or DEFAULT_SPEED_FACTORS)
    models = [m for m, _ in shape.mix]
    gpn = shape.gpus_per_node
    drafts: list[tuple[int, int, float, dict[str, float]]] = []
    for _ in range(jobs):
        gpus = _pick(rng, sizes)
        nodes, per_node = (1, gpus) if gpus <= gpn else (math.ceil(gpus / gpn), gpn)
        # Bigger jobs run longer: +25% of the median per doubling of size.
        median = median_runtime_s * (1 + 0.25 * math.log2(nodes * per_node))
        runtime = min(48 * 3600.0, max(300.0, rng.lognormvariate(math.log(median), runtime_sigma)))
        speeds = {m: round(factors.get(m, 1.0) * rng.lognormvariate(0.0, speed_spread), 3) for m in models}
        drafts.append((nodes, per_node, runtime * nodes * per_node, speeds))
    if arrival_rate <= 0:
        mean_work = sum(d[2] for d in drafts) / max(1, len(drafts))
        arrival_rate = load * fleet_capacity(shape, factors) / mean_work
    out: list[TraceJob] = []
    t = start
    width = len(str(max(jobs - 1, 1)))
    for i, (nodes, per_node, work, speeds) in enumerate(drafts):
        t += rng.expovariate(arrival_rate)
        accelerator, vendor, min_memory = "", "", 0
        accelerators: tuple[str, ...] = ()
        roll = rng.random()
        if roll < any_of_share:
            accelerators = tuple(sorted(rng.sample(models, 2)))
        elif roll < any_of_share + exact_share:
            accelerator = rng.choice(models)
        elif roll < any_of_share + exact_share + class_share:
            if rng.random() < 0.5:
                vendor = "nvidia"
            else:
                min_memory = 128
        acceptable = [m for m in models
                      if (not accelerator or m == accelerator) and (not accelerators or m in accelerators)
                      and (not vendor or MODELS[m].vendor == vendor.lower())
                      and MODELS[m].memory_mb >= min_memory * 1000]
        slowest = min(speeds[m] for m in acceptable)
        gpus = nodes * per_node
        limit = math.ceil(work / (gpus * slowest) * rng.uniform(1.2, 3.0) / 60) * 60
        tier, required, wait_s = "", False, 0.0
        if nodes > 1 and rng.random() < topology_share:
            if nodes <= shape.nodes_per_leaf:
                tier, wait_s = "leaf", 600.0
            elif nodes <= shape.block_nodes and rng.random() < 0.3:
                tier, required = "spine", True
            else:
                tier, wait_s = "spine", 1800.0
        hints = {m: speeds[m] for m in acceptable} if rng.random() < hint_share else {}
        res = Resources(nodes=nodes, gpus_per_node=per_node, accelerator=accelerator, accelerators=accelerators,
                        vendor=vendor, min_memory_gb=min_memory, speed_hints=hints)
        job_id = f"j-{i:0{width}d}"
        cls = _pick(rng, classes)
        spec = JobSpec(name=job_id, command=("python", "train.py"), resources=res, priority_class=cls,
                       time_limit_s=float(limit), topology=TopologyRequest(tier=tier, required=required, wait_s=wait_s))
        out.append(TraceJob(job_id, t, rng.choice(list(teams)), spec, work, speeds,
                            float(rng.choice(list(checkpoint_every_s)))))
    return out
