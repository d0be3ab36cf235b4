"""Starting one worker through its shim (`shim.py`), from the agent's side.

`start_worker` starts the shim in a session of its own, hands it the spec on stdin and waits for its
answer: the worker's pid, or why the worker could not be started (InvalidArgument for a command that
cannot be executed, FailedPrecondition for a problem of this node). A shim that does not answer within
`ANSWER_TIMEOUT_S` is killed. Once the allocation's record holds the worker, `commit` tells the shim;
a shim whose stdin ends without it (the agent died, or `release` was called) kills its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from trainyard_core.errors import FailedPrecondition, InvalidArgument

from . import process, shim

# Starting a Python interpreter takes a fraction of a second; a loaded host can take much longer.
ANSWER_TIMEOUT_S = 30.0
SHIM_MODULE = "trainyard_agent.workers.shim"


@dataclass(frozen=True)
class Started:
    shim: asyncio.subprocess.Process
    shim_start_time: int | None
    pid: int


async def start_worker(spec: shim.Spec, *, err_path: Path, python: str = sys.executable) -> Started:
    """Start the shim that starts the worker of `spec`; returns once the worker runs (or raises)."""
    try:
        # Owner-only, like the logs: a crashing worker's command line or env can show up in there.
        err = os.open(err_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise FailedPrecondition(f"cannot create {err_path}: {exc.strerror}") from exc
    try:
        # The shim gets the agent's environment, so it imports this package exactly as the agent did.
        proc = await asyncio.create_subprocess_exec(
            python, "-m", SHIM_MODULE, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=err, start_new_session=True)
    except OSError as exc:
        raise FailedPrecondition(f"cannot start the worker's shim ({python} -m {SHIM_MODULE}): "
                                 f"{exc.strerror or exc}") from exc
    finally:
        os.close(err)  # the shim has its own copy
    started = process.start_time(proc.pid)
    try:
        answer = await asyncio.wait_for(_exchange(proc, spec), ANSWER_TIMEOUT_S)
    except BaseException as exc:
        await _kill(proc)
        if isinstance(exc, TimeoutError):
            raise FailedPrecondition(f"the worker's shim did not answer within {ANSWER_TIMEOUT_S:.0f} s") from exc
        raise
    pid = answer.get("pid")
    if isinstance(pid, int) and pid > 1:
        return Started(shim=proc, shim_start_time=started, pid=pid)
    await _kill(proc)
    if "exec_error" in answer:
        raise InvalidArgument(f"cannot start {spec['command'][0]!r} in {spec['cwd']}: {answer['exec_error']}")
    if "error" in answer:
        raise FailedPrecondition(f"the worker's shim could not start it: {answer['error']}")
    raise FailedPrecondition(f"the worker's shim ended without starting it{_complaints(err_path)}")


async def _exchange(proc: asyncio.subprocess.Process, spec: shim.Spec) -> dict[str, object]:
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(spec).encode() + b"\n")  # json.dumps writes no newline of its own
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the shim died before reading its spec: the empty answer below says so
    line = await proc.stdout.readline()
    try:
        answer = json.loads(line) if line else {}
    except ValueError:
        answer = {"error": f"unreadable answer {line[:200]!r}"}
    return answer if isinstance(answer, dict) else {"error": f"unreadable answer {line[:200]!r}"}


def commit(started: Started) -> None:
    """The worker is recorded: its shim keeps it running, whatever happens to this agent."""
    _close_stdin(started.shim, shim.COMMIT)


def release(started: Started) -> None:
    """The launch failed: the shim kills its worker, records its end and exits."""
    _close_stdin(started.shim, b"")


def _close_stdin(proc: asyncio.subprocess.Process, data: bytes) -> None:
    if proc.stdin is None:
        return
    try:
        if data:
            proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError, RuntimeError):
        pass  # the shim is gone; its supervisor finds no status file and says so


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """End a shim whose answer was not taken, and the worker it may have started anyway: with its shim gone,
    nobody would read that worker's output or ever stop it."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    await process.wait_for_exit(proc)
    assert proc.stdout is not None
    try:
        # The shim's only writer of this pipe is dead: this reads what it left and returns.
        rest = await asyncio.wait_for(proc.stdout.read(), 1.0)
    except (TimeoutError, OSError):
        return
    for line in rest.splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            pid = int(json.loads(line)["pid"])  # KeyError: the line has no pid
            process.signal_group(pid, signal.SIGKILL)  # the worker leads its own group


def shim_stderr_tail(err_path: Path, limit: int) -> str:
    """The last `limit` characters a shim wrote to its stderr file ("" when none, or unreadable)."""
    try:
        return err_path.read_text(errors="replace").strip()[-limit:]
    except OSError:
        return ""


def _complaints(err_path: Path) -> str:
    text = shim_stderr_tail(err_path, 500)
    return f": {text}" if text else ""
