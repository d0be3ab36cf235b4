"""The read view's recent changes, for `GET /v1/jobs?watch=true` (job_view_events.py) and its resumption.

Each change is a job as it became (None: it left etcd) and as it was before (None: new to the view), at the
etcd revision of the view message that brought it; changes are appended in revision order, every change of
one revision together (one view message, or the difference a new snapshot made, applied in one step). The log
keeps the last `size` changes: it can replay everything after a revision R when R is at or after
`complete_after` (no change after it was dropped, and the log began before it), and says so (`replayable`).
Readers follow it by sequence number (`seq`), which never repeats, and wait for the next one (`wait`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainyard_core.waits import completes_within

if TYPE_CHECKING:
    from .job_view import ViewedJob


@dataclass(frozen=True, slots=True)
class Change:
    seq: int
    revision: int
    job: ViewedJob | None     # None: the job left etcd (finished and archived)
    before: ViewedJob | None  # None: the job was not in the view

    @property
    def current(self) -> ViewedJob:
        """The job as it is now, or as it last was when it left etcd."""
        found = self.job or self.before
        assert found is not None
        return found


class ChangeLog:
    def __init__(self, size: int) -> None:
        self._size = size
        self._changes: deque[Change] = deque()
        self._next = 0
        self.started = False
        # Every change after this revision is in the log.
        self.complete_after = 0
        # The revision the view has reached (every change up to it is appended).
        self.revision = 0
        self._moved: asyncio.Future[None] | None = None

    def start(self, revision: int) -> None:
        """The view's first snapshot, at `revision`: changes are logged from it on."""
        self.started = True
        self.complete_after = revision

    def append(self, revision: int, job: ViewedJob | None, before: ViewedJob | None) -> None:
        if not self.started:
            return
        self._changes.append(Change(self._next, revision, job, before))
        self._next += 1
        if len(self._changes) > self._size:
            dropped = self._changes.popleft()
            self.complete_after = max(self.complete_after, dropped.revision)

    def reached(self, revision: int) -> None:
        self.revision = max(self.revision, revision)
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(None)
        self._moved = None

    @property
    def next_seq(self) -> int:
        return self._next

    def replayable(self, revision: int) -> bool:
        """Whether every change after `revision` is still here."""
        return self.started and revision >= self.complete_after

    def seq_after(self, revision: int) -> int:
        """The seq of the first change after `revision` (`next_seq` when there is none yet)."""
        for change in self._changes:
            if change.revision > revision:
                return change.seq
        return self._next

    def since(self, seq: int) -> list[Change] | None:
        """The changes from `seq` on; None when some of them were dropped (a reader that fell too far behind)."""
        first = self._changes[0].seq if self._changes else self._next
        if seq < first:
            return None
        # From the right end: a reader that keeps up asks for the last few.
        return [self._changes[-k] for k in range(self._next - seq, 0, -1)]

    async def wait(self, seq: int, timeout_s: float) -> None:
        """Until a change with this seq exists, the view moves on, or `timeout_s` passes."""
        if seq < self._next:
            return
        if self._moved is None:
            self._moved = asyncio.get_running_loop().create_future()
        await completes_within(asyncio.shield(self._moved), timeout_s)
