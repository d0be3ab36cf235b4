"""The scheduler's garbage-collector thresholds.

The leader's heap is large and long-lived (the mirror of every node, job and allocation), and its hot
paths allocate many short-lived objects (a gang commit builds a holdings value, a compare and a write per
node). With CPython's default thresholds (700, 10, 10) a young collection runs every 700 net allocations
and a full one, which walks the whole mirror, every 100 young ones. Raising them keeps collections rare
without holding more garbage than a few megabytes: reference counting frees almost everything, the
collector only finds cycles. Measured with the scheduler benchmark's commit arm (docs/scheduler-benchmark.md).
"""

from __future__ import annotations

import gc

THRESHOLDS = (20_000, 20, 20)


def tune() -> None:
    gc.set_threshold(*THRESHOLDS)
