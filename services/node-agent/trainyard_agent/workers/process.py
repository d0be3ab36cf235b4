"""Process groups on Linux: signal them, find out whether any member is still alive.

Each worker leads its own session and process group (pgid == its pid), so one `killpg` reaches it and
everything it started (dataloader workers, shell pipelines) unless a descendant deliberately made a new
session. "Alive" ignores zombies: orphans re-parented to a PID 1 that does not reap them (common in
containers) stay zombies forever but hold no resources.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

_PROC = "/proc"


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards), or None if gone."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(")") + 2:].split()


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot; tells a process from a later one with its pid."""
    fields = _read_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def live_groups() -> set[int]:
    """Process groups that have at least one non-zombie member."""
    groups: set[int] = set()
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return groups
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _read_stat(int(entry))
        if fields is not None and fields[0] not in ("Z", "X"):
            groups.add(int(fields[2]))
    return groups


def is_running(pid: int | None, started: int | None) -> bool:
    """Whether `pid` is still the (non-zombie) process that started at `started` clock ticks."""
    return pid is not None and started is not None and start_time(pid) == started


def _pidfd_of(pid: int, started: int | None) -> tuple[bool, int | None]:
    """(running, pidfd): whether the process `pid` that started at `started` runs, and a pidfd pinning it
    (None without pidfd support). Checked again once the pidfd is open: the pid may have been reused
    between the first check and the open, never after it."""
    if not is_running(pid, started):
        return False, None
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return False, None
    except (OSError, AttributeError):
        fd = None
    if fd is not None and not is_running(pid, started):
        os.close(fd)
        return False, None
    return True, fd


def kill_process(pid: int | None, started: int | None, sig: int) -> bool:
    """Send `sig` to `pid` if it is still the process that started at `started`; False if it is gone."""
    if pid is None:
        return False
    running, fd = _pidfd_of(pid, started)
    if not running:
        return False
    try:
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


async def wait_gone(pid: int | None, started: int | None, interval: float = 0.1) -> None:
    """Return once the process `pid` that started at `started` has ended. It need not be our child (a
    worker's shim from an earlier agent life): a pidfd says when it ends; without pidfds, /proc is polled."""
    if pid is None:
        return
    running, fd = _pidfd_of(pid, started)
    if not running:
        return
    if fd is None:
        while is_running(pid, started):  # noqa: ASYNC110 - no pidfds: nothing to wait on but /proc
            await asyncio.sleep(interval)
        return
    await _until_readable_then_close(fd)


async def _until_readable_then_close(fd: int) -> None:
    """Wait until a pidfd becomes readable (its process ended), then close it."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: None if ended.done() else ended.set_result(None))
    try:
        await ended
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def group_alive(pgid: int) -> bool:
    return pgid in live_groups()


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to every process of group `pgid`; False when the group is gone."""
    if pgid <= 1 or pgid == os.getpgrp():
        # Never signal the agent's own group (or everything): a corrupt record must not kill the agent.
        log.error("refusing to signal process group %s", pgid)
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        log.error("no permission to signal process group %s", pgid)
        return False


async def wait_groups_gone(pgids: Iterable[int], timeout: float, interval: float = 0.02) -> set[int]:
    """Poll until no listed group has a live member or `timeout` passes; returns the groups still alive."""
    pending = set(pgids)
    deadline = time.monotonic() + timeout
    while pending:
        pending &= live_groups()
        if not pending or time.monotonic() >= deadline:
            break
        await asyncio.sleep(interval)
    return pending


async def wait_for_exit(proc: asyncio.subprocess.Process) -> int:
    """The return code of `proc` as soon as it ends.

    `Process.wait()` only returns once the process's pipes are closed too, which never happens while a
    descendant holds them; a pidfd (Linux >= 5.3) says when the process itself ends. asyncio's child
    watcher reaps it and sets `returncode` a moment later. Without pidfds this falls back to polling.
    """
    fd: int | None = None
    if proc.returncode is None:
        try:
            fd = os.pidfd_open(proc.pid)
        except (OSError, AttributeError):
            fd = None  # already reaped, or no pidfd support
    if fd is not None:
        await _until_readable_then_close(fd)
    # asyncio has no event for "reaped" that fires before the pipes close, hence the short poll.
    while proc.returncode is None:  # noqa: ASYNC110
        await asyncio.sleep(0.005 if fd is not None else 0.1)
    return proc.returncode
