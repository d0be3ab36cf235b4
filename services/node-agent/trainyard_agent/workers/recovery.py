"""Recovery: what an agent does at start-up with the workers an earlier life of it recorded (the
supervisor's module docstring says what happens to each).

Separate from `supervisor.py` because it runs once, before anything is served, and touches nothing the
supervisor keeps beside the worker book: it reads the record files, fills the book, and settles, adopts
or stops what it finds.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from trainyard_core.logs import log_context

from . import process, records
from .allocation import Allocation, Worker
from .book import WorkerBook
from .model import RestartPolicy, WorkerExit, WorkerSpec
from .stopping import stop_alloc

log = logging.getLogger(__name__)


async def recover(book: WorkerBook, jobs_root: Path, restart_policy: RestartPolicy,
                  stop_grace_s: float) -> list[WorkerExit]:
    """Take over, or stop, the workers of an earlier agent life (see `Supervisor.recover`)."""
    found: list[Allocation] = []
    for path in records.find_all(jobs_root):
        rec = records.load(path)
        if rec is None or (rec.job_id, rec.attempt) in book.allocs:
            continue
        alloc = Allocation(job_id=rec.job_id, attempt=rec.attempt, dir=path.parent, record=rec)
        for wr in rec.workers:
            w = Worker(spec=WorkerSpec(wr.rank, wr.local_rank, tuple(wr.gpu_indices)), record=wr)
            if wr.exit_code is not None:
                w.exit = WorkerExit(rec.job_id, rec.attempt, wr.rank, wr.exit_code, wr.signal or 0,
                                    wr.exited_at or 0.0, agent_shutdown=wr.agent_shutdown)
            alloc.workers.append(w)
        found.append(alloc)
        book.allocs[alloc.key] = alloc
    submitted = [w.exit for a in found for w in a.workers if w.exit is not None and not w.record.reported]
    for exit in submitted:
        book.exits.submit(exit)
    pending = [(a, w) for a in found for w in a.workers if w.running]
    live = [(a, w) for a, w in pending if process.is_running(w.record.shim_pid, w.record.shim_start_time)]
    live_ids = {id(w) for _, w in live}
    # Ended while no agent watched (or their shim did): settled now, before anything is served.
    await asyncio.gather(*(_settle_previous(book, a, w) for a, w in pending if id(w) not in live_ids))
    for a, w in live:
        w.task = asyncio.create_task(book.supervise(a, w), name=f"worker-{a.job_id}-{w.spec.rank}")
    adopted = list({id(a): a for a, _ in live}.values())
    for a in adopted:
        with log_context(job_id=a.job_id, attempt=a.attempt):
            ranks = [w.spec.rank for b, w in live if b is a]
            if restart_policy is RestartPolicy.STOP:
                log.warning("workers of a previous agent life are still running; stopping them (restart "
                            "policy stop)", extra={"ranks": ranks})
            else:
                log.info("workers of a previous agent life are still running; adopted them",
                         extra={"ranks": ranks, "pids": [w.record.pid for b, w in live if b is a]})
    if restart_policy is RestartPolicy.STOP:
        await asyncio.gather(*(stop_alloc(a, stop_grace_s) for a in adopted))
    submitted += [w.exit for _, w in pending if w.exit is not None]
    book.prune()
    book.publish()
    return submitted


async def _settle_previous(book: WorkerBook, alloc: Allocation, w: Worker) -> None:
    with log_context(job_id=alloc.job_id, attempt=alloc.attempt, rank=w.spec.rank):
        await book.settle(alloc, w)
        log.info("worker of a previous agent life ended", extra={"exit_code": w.record.exit_code,
                                                                  "signal": w.record.signal})
