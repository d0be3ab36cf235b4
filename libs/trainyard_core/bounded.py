"""Remembering the newest entries of an unbounded stream in a plain dict.

A leader that runs for months sees an unbounded number of jobs and calls; what it remembers of them (when a
gang was released, when a waiting job's reason was last written, an agent call's backoff) must not grow
with them. A dict keeps insertion order, so the oldest entry is the first: forgetting it first costs, at
worst, one repeated write or call for a job long gone.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(entries: dict[K, V], key: K, value: V, limit: int) -> None:
    """`entries[key] = value`, then the oldest entries (first inserted) dropped until at most `limit` remain. A
    key already there keeps its place."""
    entries[key] = value
    while len(entries) > limit:
        entries.pop(next(iter(entries)))
