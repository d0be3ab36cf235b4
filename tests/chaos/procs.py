"""The processes of a chaos run, read from /proc: workers (found by the run's marker in their environment)
and the agents' shims.

A process is identified by (pid, start time), so a recycled pid is never taken for the process it replaced;
"alive" means it exists and has not exited (a zombie has exited, its parent just has not reaped it yet).
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SHIM_MODULE = "trainyard_agent.workers.shim"


@dataclass(frozen=True)
class WorkerProc:
    pid: int
    start_time: int
    pgid: int
    job_id: str
    attempt: int
    rank: int
    node_id: str
    gpus: tuple[int, ...]

    @property
    def gang(self) -> tuple[str, int]:
        return self.job_id, self.attempt

    def describe(self) -> str:
        return (f"pid {self.pid} (job {self.job_id} attempt {self.attempt} rank {self.rank} on {self.node_id} "
                f"GPUs {list(self.gpus)})")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, start time) of a process, None when it does not exist."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[2]), int(fields[19])


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def alive(pid: int, start_time: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start_time and st[0] not in ("Z", "X")


def pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def workers(marker: str, value: str) -> list[WorkerProc]:
    """Every live process whose environment has `marker`=`value` and a Trainyard job: a worker, or a process
    a worker started (they inherit its environment)."""
    found = []
    me = os.getpid()
    for pid in pids():
        if pid == me:
            continue
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X"):
            continue
        env = _environ(pid)
        if not env or env.get(marker) != value or "TRAINYARD_JOB_ID" not in env:
            continue
        devices = env.get("CUDA_VISIBLE_DEVICES", "")
        try:
            found.append(WorkerProc(pid=pid, start_time=st[2], pgid=st[1], job_id=env["TRAINYARD_JOB_ID"],
                                    attempt=int(env.get("TRAINYARD_ATTEMPT", "0")), rank=int(env.get("RANK", "-1")),
                                    node_id=env.get("TRAINYARD_NODE_ID", ""),
                                    gpus=tuple(int(g) for g in devices.split(",") if g.strip().isdigit())))
        except ValueError:
            continue
    return found


def shims(node_state_dir: str) -> list[tuple[int, int]]:
    """(pid, start time) of the live shims started by the agent whose state dir is `node_state_dir`."""
    found = []
    for pid in pids():
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X"):
            continue
        try:
            cmdline = (PROC / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if SHIM_MODULE.encode() not in cmdline:
            continue
        env = _environ(pid) or {}
        if env.get("TRAINYARD_AGENT_STATE_DIR") == node_state_dir:
            found.append((pid, st[2]))
    return found


def kill(pid: int, start_time: int, *, group: bool = False) -> bool:
    """SIGKILL the process (or its process group) if it is still the one we saw; whether a signal was sent."""
    if not alive(pid, start_time):
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    return False
