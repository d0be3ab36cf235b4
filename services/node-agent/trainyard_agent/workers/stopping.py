"""Stopping workers: signal their process groups, escalate to SIGKILL after the grace, wait for their
shims to record the exits.

Separate from `supervisor.py` because stopping needs none of the supervisor's state: a StopWorkers call,
the agent's shutdown, recovery under `RestartPolicy.STOP` and a worker found running without its shim
all end groups the same way, whoever asks.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from . import process
from .allocation import Allocation, Worker

log = logging.getLogger(__name__)

# After a worker exits, how long its shim may still drain its output before abandoning the pipes.
DRAIN_TIMEOUT_S = 5.0
# After SIGKILL, how long to wait for the kernel to take processes away (D state can delay it).
KILL_WAIT_S = 10.0


async def stop_alloc(alloc: Allocation, grace: float, first: signal.Signals = signal.SIGTERM) -> int:
    """Stop the running workers of `alloc`; returns how many were running. Concurrent stops of one
    allocation wait for the same termination (the later ones count 0)."""
    if alloc.stop_task is not None and not alloc.stop_task.done():
        await asyncio.shield(alloc.stop_task)
        return 0
    running = [w for w in alloc.workers if w.running]
    if not running:
        return 0
    log.info("stopping workers", extra={"attempt": alloc.attempt, "ranks": [w.spec.rank for w in running],
                                        "grace_s": grace})
    alloc.stop_task = asyncio.create_task(terminate(running, grace, first))
    await asyncio.shield(alloc.stop_task)
    return len(running)


async def terminate(workers: list[Worker], grace: float, first: signal.Signals = signal.SIGTERM) -> None:
    await end_groups(workers, grace, first)
    # The supervise tasks record the exits once the shims have drained the output and ended; wait for
    # them so the caller sees the exits recorded.
    tasks = {w.task: w for w in workers if w.task is not None}
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S + 1)
    if pending:
        # Their workers are gone, yet the shims do not end (stuck writing the log?): end them.
        log.error("worker shims do not end after their workers; killing them",
                  extra={"ranks": [tasks[t].spec.rank for t in pending]})
        for task in pending:
            rec = tasks[task].record
            process.kill_process(rec.shim_pid, rec.shim_start_time, signal.SIGKILL)
        await asyncio.wait(pending, timeout=KILL_WAIT_S)


async def end_groups(workers: list[Worker], grace: float, first: signal.Signals = signal.SIGTERM) -> None:
    """Send `first` (SIGTERM by default) to the workers' process groups, SIGKILL those still there after
    `grace`; returns when they are gone, or KILL_WAIT_S after SIGKILL for processes stuck in the kernel."""
    by_pgid = {w.record.pgid: w for w in workers}
    for pgid, w in by_pgid.items():
        w.stop_signal = first
        process.signal_group(pgid, first)
    left = await process.wait_groups_gone(by_pgid, grace)
    if left:
        log.warning("workers ignored %s for the grace period; killing", first.name,
                    extra={"pgids": sorted(left)})
        for pgid in left:
            by_pgid[pgid].stop_signal = signal.SIGKILL
            process.signal_group(pgid, signal.SIGKILL)
        stuck = await process.wait_groups_gone(left, KILL_WAIT_S)
        if stuck:
            log.error("processes survive SIGKILL (stuck in the kernel?)", extra={"pgids": sorted(stuck)})
