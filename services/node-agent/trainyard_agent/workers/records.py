"""Worker record files: what a later agent life needs to find this life's workers.

One JSON file per allocation, `<state_dir>/jobs/<job_id>/attempt-<n>/workers.json`, rewritten atomically
(write a temporary file, fsync, rename) whenever a worker starts, ends or its exit is acknowledged by
the scheduler. `start_time` (clock ticks since boot, from /proc) tells our worker, or its shim, from an
unrelated process that got the same pid after a reboot or pid wrap-around.

Beside it, per rank, files the agent does not write: `rank-<r>.exit.json`, the worker's end as its shim
recorded it (`shim.write_status`), and `rank-<r>.shim.err`, the shim's own complaints (usually empty).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

RECORD_NAME = "workers.json"


@dataclass
class WorkerRecord:
    rank: int
    local_rank: int
    gpu_indices: list[int]
    pid: int
    pgid: int
    start_time: int | None
    exit_code: int | None = None
    signal: int | None = None
    exited_at: float | None = None
    # The shim that started the worker and keeps its output and exit status (`shim.py`); None in records of
    # agents without shims, whose workers a later life cannot adopt.
    shim_pid: int | None = None
    shim_start_time: int | None = None
    # The scheduler acknowledged the exit report; nothing is left to do for this worker.
    reported: bool = False
    # It ended while the agent shut down with its workers (WorkerExit.agent_shutdown).
    agent_shutdown: bool = False


@dataclass
class AllocationRecord:
    job_id: str
    attempt: int
    node_id: str
    created_at: float
    workers: list[WorkerRecord] = field(default_factory=list)
    # The job's team (the metrics label the GPUs it holds with it); "" in records of older agents.
    team: str = ""


def save(path: Path, record: AllocationRecord) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(record), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def status_path(adir: Path, rank: int) -> Path:
    return adir / f"rank-{rank}.exit.json"


def shim_err_path(adir: Path, rank: int) -> Path:
    return adir / f"rank-{rank}.shim.err"


def load(path: Path) -> AllocationRecord | None:
    """The record at `path`; None (and the file set aside as `.corrupt`) when it cannot be parsed."""
    try:
        data = json.loads(path.read_text())
        workers = [WorkerRecord(**w) for w in data.pop("workers")]
        return AllocationRecord(**data, workers=workers)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        log.error("unreadable worker record %s (%s); setting it aside", path, exc)
        os.replace(path, path.with_name(path.name + ".corrupt"))
        return None


def find_all(jobs_root: Path) -> list[Path]:
    if not jobs_root.is_dir():
        return []
    return sorted(jobs_root.glob(f"*/attempt-*/{RECORD_NAME}"))
