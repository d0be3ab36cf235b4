"""Helpers of the node agent's tests: builders for launch requests and supervisors, a recording exit sink,
and a process-tree script. Worker processes are real (`sys.executable`)."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from trainyard_agent.model import Health, Vendor
from trainyard_agent.notify import Notifier
from trainyard_agent.settings import AgentSettings
from trainyard_agent.workers.model import LaunchRequest, WorkerExit, WorkerSpec
from trainyard_agent.workers.supervisor import Supervisor
from trainyard_core.testing.wait import eventually

PY = sys.executable

# A process tree for group tests: each level appends its pid to a file, starts the next level, then
# sleeps (or exits at once with mode "exit" at the top). With "ignore" SIGTERM is ignored by every level
# (SIG_IGN survives exec).
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    depth, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if depth > 0:
        subprocess.Popen([sys.executable, __file__, str(depth - 1), out, "sleep" if mode == "exit" else mode])
    with open(out, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if mode == "exit":
        # Leave only once the whole tree has started, so its descendants are there to be cleaned up.
        while len(open(out).read().split()) < depth + 1:
            time.sleep(0.01)
        sys.exit(0)
    time.sleep(300)
""")


class RecordingSink:
    def __init__(self) -> None:
        self.exits: list[WorkerExit] = []
        self.changed = Notifier()

    def submit(self, exit: WorkerExit) -> None:
        self.exits.append(exit)
        self.changed.notify()

    def by_rank(self, job_id: str) -> dict[int, WorkerExit]:
        return {e.rank: e for e in self.exits if e.job_id == job_id}


async def until(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    async def probe() -> object:
        return predicate()

    await eventually(probe, timeout=timeout, what=what)


def launch(job_id: str, command: list[str], *, ranks: int = 1, gpus_per_rank: int = 0, attempt: int = 1,
           env: dict[str, str] | None = None, working_dir: str = "", epoch: int = 0) -> LaunchRequest:
    workers = tuple(WorkerSpec(rank=r, local_rank=r,
                               gpu_indices=tuple(range(r * gpus_per_rank, (r + 1) * gpus_per_rank)))
                    for r in range(ranks))
    return LaunchRequest(job_id=job_id, attempt=attempt, command=tuple(command), env=env or {},
                         working_dir=working_dir, workers=workers, leader_epoch=epoch)


def make_supervisor(state_dir: Path, sink: RecordingSink, *, gpus: int = 4, grace: float = 5.0,
                    health: list[tuple[Health, str]] | None = None, vendor: Vendor = Vendor.NVIDIA,
                    log_max_bytes: int = 1 << 20, log_backups: int = 2) -> Supervisor:
    states = health if health is not None else [(Health.HEALTHY, "")] * gpus
    return Supervisor(state_dir=state_dir, node_id="node-a", vendor=vendor, gpu_health=lambda: states,
                      base_env=dict(os.environ), site_env={"SITE_DEFAULT": "1", "OVERRIDDEN": "site"},
                      stop_grace_s=grace, log_max_bytes=log_max_bytes, log_backups=log_backups, exits=sink)


def read_pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def agent_settings(state_dir: Path, scheduler_address: str, **overrides: object) -> AgentSettings:
    values: dict[str, object] = dict(
        node_id="node-a", scheduler_address=scheduler_address, gpu_profile="h100x8", state_dir=str(state_dir),
        heartbeat_interval_s=0.2, stop_grace_s=2.0, labels={"rack": "r1", "switch": "s2"},
        worker_env={"GLOO_SOCKET_IFNAME": "lo"}, reconnect_initial_s=0.05, reconnect_max_s=0.3)
    values.update(overrides)
    return AgentSettings.model_validate(values)
