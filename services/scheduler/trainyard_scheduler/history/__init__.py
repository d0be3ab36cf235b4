"""The scheduler's history store: finished jobs and usage records in SQL (PostgreSQL, or an SQLite file).

The names below are loaded on first use (PEP 562), so that `python -m trainyard_scheduler.history.migrate` does
not import the migrate module twice (once through the store, once as __main__).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import ArchivedJob, HistoryStore, HistoryUnavailable, JobFilter, Pruned, UsageRecord

__all__ = ["ArchivedJob", "HistoryStore", "HistoryUnavailable", "JobFilter", "Pruned", "UsageRecord"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module(".store", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
