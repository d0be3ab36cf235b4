"""The agent's in-memory state of the workers it supervises: an `Allocation` per (job_id, attempt), a
`Worker` per rank.

Separate from `supervisor.py` because every part of supervision shares it: the launcher makes it, the
worker book keeps it and records exits in it, stopping and recovery act on it. Each entry wraps its
record (`records.py`), what a later agent life knows of it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from . import records
from .model import WorkerExit, WorkerSpec

log = logging.getLogger(__name__)


@dataclass
class Worker:
    spec: WorkerSpec
    record: records.WorkerRecord
    # The shim this agent life started; None for a worker of a previous life (found by pid in the record).
    shim: asyncio.subprocess.Process | None = None
    exit: WorkerExit | None = None
    task: asyncio.Task[None] | None = None
    # The last signal a stop sent to the worker's group: what ended it, should its shim not say.
    stop_signal: int = 0

    @property
    def running(self) -> bool:
        return self.exit is None


@dataclass
class Allocation:
    job_id: str
    attempt: int
    dir: Path
    record: records.AllocationRecord
    workers: list[Worker] = field(default_factory=list)
    stop_task: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)

    @property
    def running(self) -> bool:
        return any(w.running for w in self.workers)

    def save(self) -> None:
        """Persist the record; a failure is logged (the exit is still reported from memory, but a later
        agent life would not know it was)."""
        try:
            records.save(self.dir / records.RECORD_NAME, self.record)
        except OSError as exc:
            log.error("cannot update the worker record", extra={"path": str(self.dir), "error": str(exc)})
