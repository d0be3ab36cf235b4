"""Test hook for crash-safety tests: instrumented points in the save path where the process can be made
to SIGKILL itself, so a test can stop a save at every stage (each file write, fsyncs, the metadata
rename, before and after the commit call) without timing luck.

`TRAINYARD_TEST_KILL_AT=<n>` or `<rank>:<n>`: the process (of that rank) kills itself at its n-th point.
`TRAINYARD_TEST_KILL_TRACE=<path>`: every rank appends `<n> <point name>` for every point (`{rank}` in the
path is replaced by the rank), which tells a test how many points a save has. Both unset: `hit` is a no-op.

Points are counted per process in the order they happen; writer threads share one counter, so which
file a mid-write point falls in may vary between runs, but the phase (writing, finishing, committing)
does not.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True, slots=True)
class KillSpec:
    at: int | None  # the n-th point, counting from 1
    rank: int | None  # only this rank; None: any
    trace_path: str  # "" for none


def parse_kill_at(kill_at: str, trace_path: str) -> KillSpec | None:
    kill_at = kill_at.strip()
    if not kill_at and not trace_path:
        return None
    at: int | None = None
    rank: int | None = None
    if kill_at:
        rank_text, _, n_text = kill_at.rpartition(":")
        try:
            at = int(n_text)
            rank = int(rank_text) if rank_text else None
        except ValueError:
            raise ConfigError(f"TRAINYARD_TEST_KILL_AT={kill_at!r} must be <n> or <rank>:<n>") from None
        if at < 1:
            raise ConfigError(f"TRAINYARD_TEST_KILL_AT={kill_at!r}: points count from 1")
    return KillSpec(at=at, rank=rank, trace_path=trace_path)


class KillPoints:
    """Counts the points one process passes; thread-safe."""

    def __init__(self, spec: KillSpec | None, rank: int) -> None:
        self._enabled = spec is not None
        self._at = spec.at if spec is not None and spec.rank in (None, rank) else None
        self._trace = spec.trace_path.replace("{rank}", str(rank)) if spec is not None else ""
        self._count = 0
        self._lock = threading.Lock()

    def hit(self, name: str) -> None:
        if not self._enabled:
            return
        with self._lock:
            self._count += 1
            if self._trace:
                with open(self._trace, "a") as f:
                    f.write(f"{self._count} {name}\n")
            if self._count == self._at:
                os.kill(os.getpid(), signal.SIGKILL)


DISABLED = KillPoints(None, 0)
