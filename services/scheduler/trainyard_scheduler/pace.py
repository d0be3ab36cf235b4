"""The reconcile loop's pace: how long it rests after a cycle (reconcile.py), and the default of the setting
(`reconcile_pace_us_per_pending_job`, settings.py)."""

from __future__ import annotations

# The rest after a cycle per pending job its placement looked at.
PACE_S_PER_PENDING_JOB = 50e-6
# A shorter rest is not taken (a timer per cycle would cost more than it saves): a queue of under 20 jobs at
# the default pace is decided on every change, as before.
MIN_PAUSE_S = 0.001


def cycle_pause_s(considered: int, per_job_s: float, cap_s: float) -> float:
    """How long the loop rests after a cycle whose placement looked at `considered` pending jobs.

    Every change in etcd wakes the loop, and every cycle walks the whole pending queue; under a burst of submits
    over a backlog the cycles ran back to back, each a walk of thousands of jobs, and took the event loop from
    the API that takes the submits (Slurm bounds its main loop so with sched_min_interval). A rest in
    proportion to the walk bounds the share of the loop placement can take whatever the backlog, while a
    short queue is decided at once: 20 jobs rest 1 ms, a backlog of 2,000 0.1 s (at 50 us a job); the
    changes that arrive meanwhile are taken together by the next cycle."""
    return min(cap_s, max(0, considered) * per_job_s)
