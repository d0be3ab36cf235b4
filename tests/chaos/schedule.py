"""Pure: a seed → the whole plan of a chaos run (faults with their times and parameters, the job stream).

Everything random in a run is drawn here, up front, from one `random.Random(seed)`, so the same seed gives
the same plan: the same faults at the same offsets with the same parameters, and the same jobs in the same
order. What the plan meets when it runs (which worker is alive at second 42) still depends on timing; a
fault's `pick` is a number in [0, 1) that chooses among whatever targets exist at that moment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Fault kinds and how often each is drawn (relative weights).
FAULT_WEIGHTS: dict[str, float] = {
    "worker_kill": 3.0,        # SIGKILL one live worker process
    "agent_kill": 2.0,         # SIGKILL a node agent (its workers live on in their shims); restart it later
    "host_crash": 1.0,         # SIGKILL a node agent and every process of that node; restart the agent later
    "xid": 3.0,                # inject an XID on a simulated GPU; an operator repairs it later
    "scheduler_leader_kill": 1.0,  # SIGKILL the leading scheduler replica; restart it (it stands by)
    "etcd_member_kill": 1.0,   # SIGKILL one of the 3 etcd members; restart it with its data
    "checkpoint_store_restart": 1.0,  # SIGKILL or SIGTERM the checkpoint-store and start it again
    # Network faults (netfaults.py; they need network namespaces: root).
    "partition_agent_leader": 1.0,     # cut a node from the leader's host; the standby stays reachable
    "partition_leader_etcd": 0.6,      # cut the leader's host from every etcd member
    "partition_gateway_scheduler": 0.5,  # cut the gateway from the leader or from every replica
    "isolate_node": 0.7,               # cut a node from every peer
    "packet_loss": 0.7,                # random loss on a node's link, both ways
    "latency": 1.0,                    # delay (with jitter) on a node's link, round trip below 1 s
    # Frozen processes: SIGSTOP, SIGCONT after the drawn time (netfaults.py).
    "freeze_agent": 0.7,
    "freeze_scheduler": 0.7,           # the leader or the standby
    "freeze_etcd_member": 0.5,
}
# The kinds that need network namespaces (netns.available()); left out of the plan, and said so, without.
NETWORK_KINDS = frozenset({"partition_agent_leader", "partition_leader_etcd", "partition_gateway_scheduler",
                           "isolate_node", "packet_loss", "latency"})
# Latency drawn for the `latency` kind, one way: the round trip 2 * (delay + jitter) stays below a second, well
# inside the 2 s pulse acknowledgement window, so the node must not die of it (invariant (f)).
LATENCY_MS = (50.0, 300.0)
MAX_JITTER_MS = 50.0
LOSS_PCT = (5.0, 30.0)

# XIDs and their weights. What each does is the agent's policy (health/xid_catalog.py), not ours:
# 79 reboot_host (unhealthy, node cordoned), 48 reset_gpu (unhealthy), 63 and 94 restart_job (degraded),
# 13 application error (ignored: the GPU stays healthy).
XID_WEIGHTS: dict[int, float] = {79: 2.0, 48: 2.0, 63: 1.0, 94: 1.0, 13: 1.0}

JOB_KINDS: dict[str, float] = {
    "sleep": 3.0,        # python sleeps a few seconds; 1 node, 1-2 GPUs
    "sleep_gang": 1.5,   # the same on 2 nodes
    "flaky": 0.5,        # exits 3 on its first attempt (an application failure), succeeds after a restart
    "ckpt": 2.5,         # tests/chaos/programs/train.py with checkpoints; 1 node
    "ckpt_gang": 1.5,    # the same on 2 nodes over gloo
}


@dataclass(frozen=True)
class Fault:
    at: float                 # seconds after the start of the chaos phase
    kind: str
    pick: float               # chooses the target among those that exist when the fault fires
    gpu_pick: float = 0.0
    xid: int = 0
    down_s: float = 0.0       # how long the killed, frozen or cut thing stays so (repair delay for an XID)
    graceful: bool = False    # checkpoint-store: SIGTERM instead of SIGKILL
    amount: float = 0.0       # packet_loss: percent; latency: one-way delay in ms
    jitter_ms: float = 0.0    # latency: ± this around the delay
    scope: str = ""           # partition_gateway_scheduler: "leader" or "all"; freeze_scheduler: "leader" or
                              # "standby"

    def describe(self) -> str:
        extra = {"xid": f" xid={self.xid}", "checkpoint_store_restart": " SIGTERM" if self.graceful else " SIGKILL",
                 "packet_loss": f" loss={self.amount:.1f}%",
                 "latency": f" delay={self.amount:.0f}±{self.jitter_ms:.0f}ms",
                 "partition_gateway_scheduler": f" from={self.scope}", "freeze_scheduler": f" which={self.scope}"}
        return f"t+{self.at:6.1f}s {self.kind}{extra.get(self.kind, '')} down={self.down_s:.1f}s pick={self.pick:.3f}"


@dataclass(frozen=True)
class JobPlan:
    index: int
    kind: str
    nodes: int
    gpus_per_node: int
    run_s: float              # sleep jobs: how long; checkpoint jobs: seconds per step
    steps: int = 0
    every: int = 0
    async_save: bool = False
    keep_last: int = 0
    max_restarts: int = 0
    backoff_s: float = 0.0
    cancel_after_s: float | None = None   # the job is cancelled this long after it was accepted

    @property
    def name(self) -> str:
        return f"chaos-{self.index:04d}-{self.kind.replace('_', '-')}"


@dataclass(frozen=True)
class Plan:
    seed: int
    duration_s: float
    faults: tuple[Fault, ...]
    jobs: tuple[JobPlan, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def fault_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.faults:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out


def _choice(rng: random.Random, weights: dict[Any, float]) -> Any:
    keys = list(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def make_plan(seed: int, duration_s: float, *, kinds: frozenset[str] | None = None, mean_gap_s: float = 4.0,
              first_fault_s: float = 5.0, max_jobs: int = 100_000) -> Plan:
    """Faults from `first_fault_s` to `duration_s`, gaps drawn around `mean_gap_s`, of the given `kinds`
    (default: all); a job stream long enough for the whole run (the runner submits from it as capacity
    allows). The plan is a function of (seed, duration, kinds)."""
    unknown = sorted((kinds or frozenset()) - FAULT_WEIGHTS.keys())
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(FAULT_WEIGHTS)}")
    weights = {k: w for k, w in FAULT_WEIGHTS.items() if kinds is None or k in kinds}
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = first_fault_s
    while weights and t < duration_s:
        kind = _choice(rng, weights)
        pick, gpu_pick = rng.random(), rng.random()
        if kind == "xid":
            faults.append(Fault(t, kind, pick, gpu_pick, xid=_choice(rng, XID_WEIGHTS), down_s=rng.uniform(3, 15)))
        elif kind in ("agent_kill", "host_crash"):
            # Some restarts come back before the scheduler's node deadline, some well after it.
            faults.append(Fault(t, kind, pick, gpu_pick, down_s=rng.choice((rng.uniform(0.2, 1.5),
                                                                            rng.uniform(3.0, 10.0)))))
        elif kind == "scheduler_leader_kill":
            faults.append(Fault(t, kind, pick, gpu_pick, down_s=rng.uniform(0.5, 6.0)))
        elif kind == "etcd_member_kill":
            faults.append(Fault(t, kind, pick, gpu_pick, down_s=rng.uniform(1.0, 10.0)))
        elif kind == "checkpoint_store_restart":
            faults.append(Fault(t, kind, pick, gpu_pick, down_s=rng.uniform(0.0, 4.0), graceful=rng.random() < 0.3))
        elif kind in NETWORK_KINDS or kind.startswith("freeze_"):
            faults.append(_network_or_freeze(rng, t, kind, pick, gpu_pick))
        else:
            faults.append(Fault(t, kind, pick, gpu_pick))
        t += rng.uniform(0.25, 1.75) * mean_gap_s
    # Generous: the runner keeps a bounded number in flight and stops submitting when the faults stop.
    count = min(max_jobs, int(duration_s * 2) + 20)
    jobs = tuple(_job(rng, i) for i in range(count))
    return Plan(seed=seed, duration_s=duration_s, faults=tuple(faults), jobs=jobs)


def _network_or_freeze(rng: random.Random, t: float, kind: str, pick: float, gpu_pick: float) -> Fault:
    """Durations are drawn on both sides of the deadline that decides what happens: a node's (node_timeout_s,
    2.5 s) for faults of one node, the leader lease (leader_ttl_s, 3 s) for the scheduler's, and for an etcd
    member its election timeout (0.1 s) or a client's request timeout (2 s)."""
    if kind in ("partition_agent_leader", "isolate_node", "freeze_agent"):
        return Fault(t, kind, pick, gpu_pick, down_s=rng.choice((rng.uniform(0.2, 0.9), rng.uniform(3.0, 12.0))))
    if kind == "partition_leader_etcd":
        return Fault(t, kind, pick, gpu_pick, down_s=rng.choice((rng.uniform(0.5, 2.0), rng.uniform(4.0, 10.0))))
    if kind == "partition_gateway_scheduler":
        return Fault(t, kind, pick, gpu_pick, down_s=rng.uniform(1.0, 10.0), scope=rng.choice(("leader", "all")))
    if kind == "packet_loss":
        return Fault(t, kind, pick, gpu_pick, down_s=rng.uniform(4.0, 15.0), amount=rng.uniform(*LOSS_PCT))
    if kind == "latency":
        delay = rng.uniform(*LATENCY_MS)
        return Fault(t, kind, pick, gpu_pick, down_s=rng.uniform(5.0, 15.0), amount=delay,
                     jitter_ms=rng.uniform(0.0, min(MAX_JITTER_MS, delay / 4)))
    if kind == "freeze_scheduler":
        return Fault(t, kind, pick, gpu_pick, down_s=rng.choice((rng.uniform(0.2, 2.0), rng.uniform(4.0, 10.0))),
                     scope=rng.choice(("leader", "standby")))
    if kind == "freeze_etcd_member":
        return Fault(t, kind, pick, gpu_pick, down_s=rng.choice((rng.uniform(0.02, 0.08), rng.uniform(0.3, 1.5),
                                                                 rng.uniform(2.5, 8.0))))
    raise ValueError(f"not a network or freeze fault: {kind}")


def _job(rng: random.Random, index: int) -> JobPlan:
    kind = _choice(rng, JOB_KINDS)
    nodes = 2 if kind in ("sleep_gang", "ckpt_gang") else 1
    gpus = rng.choice((1, 1, 2)) if kind in ("sleep", "flaky") else 1
    max_restarts = rng.choice((0, 1, 2, 3))
    backoff = rng.choice((0.0, 0.5, 1.0))
    cancel = rng.uniform(1.0, 10.0) if rng.random() < 0.06 else None
    if kind in ("ckpt", "ckpt_gang"):
        steps = rng.randint(15, 40)
        return JobPlan(index, kind, nodes, gpus, run_s=rng.uniform(0.1, 0.25), steps=steps,
                       every=rng.randint(3, 6), async_save=rng.random() < 0.4,
                       keep_last=rng.choice((0, 0, 2, 3)), max_restarts=max_restarts, backoff_s=backoff,
                       cancel_after_s=cancel)
    if kind == "flaky":
        max_restarts = max(1, max_restarts)
    return JobPlan(index, kind, nodes, gpus, run_s=rng.uniform(1.0, 8.0), max_restarts=max_restarts,
                   backoff_s=backoff, cancel_after_s=cancel)
