"""The worker fence: a lease the agent renews with every answer of the scheduler leader, and that the
worker shims watch. When it runs out, the agent has died or lost the leader for longer than the fence,
and the leader will have declared the node lost and restarted its jobs elsewhere: every shim kills its
worker, so an old attempt of a restarted job never keeps running beside the new one.

The lease is one small file in the agent's state directory holding a deadline on CLOCK_MONOTONIC (one
clock for every process of the host, unaffected by wall-clock changes). No file: no fence (the scheduler
asked for none, or the agent never reached it). Standard library only: the shim imports it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

LEASE_NAME = "scheduler-lease"


def renew(path: Path, seconds: float) -> None:
    """Move the deadline to `seconds` from now (atomically: write, rename); `seconds` <= 0 removes the
    lease, and with it the fence."""
    if seconds <= 0:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{time.monotonic() + seconds:.3f}\n")
    os.replace(tmp, path)


def expired(path: Path) -> bool:
    """True once the deadline in `path` has passed; False while it has not, or when there is no lease (or
    it cannot be read: a half-written file is never there, so that is a missing or foreign file)."""
    try:
        deadline = float(path.read_text())
    except (OSError, ValueError):
        return False
    return time.monotonic() > deadline
