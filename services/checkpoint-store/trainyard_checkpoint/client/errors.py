"""Errors of the client library. All are ordinary `Exception`s: DCP's own `CheckpointException` derives
from `BaseException` (so `except Exception` in a training loop misses it); the library converts it.

Every error here pickles faithfully, because it crosses process boundaries: DCP gathers each rank's
exception to the coordinator, and the async saver process sends its outcome to the trainer.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any


class CheckpointError(Exception):
    """A save or a load failed. `failures` maps a rank to the exception that rank raised, when known."""

    def __init__(self, message: str, failures: Mapping[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.failures: dict[int, BaseException] = dict(failures or {})

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.failures))


class ConfigError(CheckpointError):
    """The client cannot be set up (an environment variable is missing or malformed)."""


class ShardCorrupt(CheckpointError):
    """A file of a checkpoint is missing, has the wrong size, or its bytes do not match its checksum.

    `shard` is the file's path relative to the checkpoint's location; `detail` says what differs (for a
    checksum mismatch: which chunk, with its byte range).
    """

    def __init__(self, shard: str, detail: str, location: str = "") -> None:
        where = f" in {location}" if location else ""
        super().__init__(f"shard {shard!r}{where}: {detail}")
        self.shard = shard
        self.detail = detail
        self.location = location

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.shard, self.detail, self.location))


class NoUsableCheckpoint(CheckpointError):
    """The job has committed checkpoints, but none of them could be loaded intact."""


def _one_line(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def integrity_failures(failures: Mapping[int, BaseException]) -> list[ShardCorrupt] | None:
    """The ShardCorrupt errors when every failure is one (the checkpoint is damaged, try an older one);
    None when any rank failed for another reason (a bug or an environment problem: falling back would
    hide it)."""
    found: list[ShardCorrupt] = []
    for exc in failures.values():
        if isinstance(exc, ShardCorrupt):
            found.append(exc)
        elif isinstance(exc, FileNotFoundError):
            found.append(ShardCorrupt(str(exc.filename or "?"), "missing"))
        else:
            return None
    return found


def from_dcp(exc: BaseException, what: str) -> CheckpointError:
    """Convert DCP's CheckpointException (a BaseException) into a CheckpointError naming each rank's
    failure. The full per-rank tracebacks DCP collected are kept in the message's tail."""
    raw = getattr(exc, "failures", None)
    failures: dict[int, BaseException] = {}
    if isinstance(raw, Mapping):
        for rank, pair in raw.items():
            failure = pair[0] if isinstance(pair, tuple) else pair
            if isinstance(failure, BaseException):
                failures[int(rank)] = failure
    if not failures:
        return CheckpointError(f"{what} failed: {_one_line(exc)}")
    if len(failures) == 1:
        (rank, only), = failures.items()
        if isinstance(only, CheckpointError):
            # Already a message of ours (a commit refused, a corrupt shard): keep its type.
            return only
    lines = [f"{what} failed on rank(s) {sorted(failures)}:"]
    lines += [f"  rank {rank}: {_one_line(failure)}" for rank, failure in sorted(failures.items())]
    return CheckpointError("\n".join(lines) + "\n" + str(exc), failures)
