"""Pure: an allocation and its job → what each node's agent must start.

Every worker gets the standard torch.distributed environment. The scheduler sets what is the same on a
node (MASTER_ADDR/PORT, WORLD_SIZE, NODE_RANK, LOCAL_WORLD_SIZE, TRAINYARD_*); the agent adds what differs
per process (RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES) from the worker specs below.
"""

from __future__ import annotations

from dataclasses import dataclass

from .domain.models import Allocation, Job


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    rank: int
    local_rank: int
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeLaunch:
    node_id: str
    job_id: str
    attempt: int
    command: tuple[str, ...]
    env: dict[str, str]
    working_dir: str
    workers: tuple[WorkerPlan, ...]
    # The job's team: the agent runs its workers as the Unix identity it maps the team to.
    team: str = ""


def checkpoint_env(job: Job, store_address: str) -> dict[str, str]:
    """Where the job's checkpoint library finds the checkpoint-store, and the job's checkpoint policy.
    On a restart the same job id reaches the same store, whose latest committed checkpoint is where the
    workers resume from."""
    env: dict[str, str] = {}
    if store_address:
        env["TRAINYARD_CHECKPOINT_STORE"] = store_address
    c = job.spec.checkpoint
    if c.every_steps:
        env["TRAINYARD_CHECKPOINT_EVERY_STEPS"] = str(c.every_steps)
    if c.interval_s:
        env["TRAINYARD_CHECKPOINT_INTERVAL_S"] = f"{c.interval_s:g}"
    if c.keep_last:
        env["TRAINYARD_CHECKPOINT_KEEP_LAST"] = str(c.keep_last)
    return env


def node_launches(job: Job, alloc: Allocation, checkpoint_store: str = "") -> list[NodeLaunch]:
    world = alloc.world_size
    out = []
    for a in alloc.assignments:
        env = dict(job.spec.env)
        env.update({
            "MASTER_ADDR": alloc.master_addr,
            "MASTER_PORT": str(alloc.master_port),
            "WORLD_SIZE": str(world),
            "NODE_RANK": str(a.node_rank),
            "GROUP_RANK": str(a.node_rank),
            "LOCAL_WORLD_SIZE": str(len(a.ranks)),
            "TRAINYARD_JOB_ID": job.id,
            "TRAINYARD_JOB_NAME": job.spec.name,
            "TRAINYARD_ATTEMPT": str(alloc.attempt),
            "TRAINYARD_NNODES": str(len(alloc.assignments)),
            **checkpoint_env(job, checkpoint_store),
        })
        if job.trace_parent:
            # The submit's trace (W3C traceparent): the checkpoint client sends it with every call, so the
            # checkpoint-store's spans of the job's saves and loads join the job's trace; user code may too.
            env["TRAINYARD_TRACEPARENT"] = job.trace_parent
        if a.gpu_indices:
            workers = tuple(WorkerPlan(rank=r, local_rank=i, gpu_indices=(g,))
                            for i, (r, g) in enumerate(zip(a.ranks, a.gpu_indices, strict=True)))
        else:  # a CPU task: one worker per node, no GPU
            workers = tuple(WorkerPlan(rank=r, local_rank=i, gpu_indices=()) for i, r in enumerate(a.ranks))
        out.append(NodeLaunch(node_id=a.node_id, job_id=job.id, attempt=alloc.attempt,
                              command=job.spec.command, env=env, working_dir=job.spec.working_dir,
                              workers=workers, team=job.team))
    return out
