"""The shim: a small process between the agent and one worker, so that the worker does not depend on the agent.

The agent starts one shim per worker (`python -m trainyard_agent.workers.shim`), in a session of its own.
The shim

1. reads its spec, one line of JSON (`Spec`), from stdin: the worker's env can hold secrets, so it is
   not put on a command line anyone can read;
2. binds itself to the spec's CPUs, if any (the worker inherits the binding), and starts the worker in a
   new session: its own process group (pgid == pid), stdin /dev/null, stdout and stderr on pipes the
   shim reads, umask 077, and, when the spec names a uid (the job's team has one: `tenancy.py`), as that
   uid and gid with no supplementary groups. Only the worker changes identity, in its child process right
   before exec: the shim itself stays with the agent's (root), so that the worker can reach neither the
   control pipe on the shim's stdin, nor the shim's memory, nor the log and status files it writes (in
   the agent's 0700 directories; the shim's own umask is 077 too, so they are 0600);
3. answers on stdout with one JSON line and closes stdout: `{"pid": N}`, `{"exec_error": "<strerror>"}`
   when the command cannot be started, or `{"error": "<message>"}` for any other failure;
4. writes the worker's output to its rank log (bounded and rotated: `logwriter.RankLog`) as it comes,
   and waits on stdin for `COMMIT`, which the agent sends once the allocation's record (with this
   worker's pid) is saved. If stdin ends first, the launch failed or the agent died during it: nothing
   would ever find this worker, so the shim kills its group and goes on as below;
5. when the worker ends, SIGKILLs what is left of its process group (nothing outlives a worker; the
   group is killed before the leader is reaped, while its id cannot be reused), drains the pipes for at
   most `drain_timeout_s` (a descendant that left the group could hold them open forever), writes the
   worker's status to `status_path` atomically (`write_status`), and exits 0.

The shim, not the agent, is the worker's parent and the reader of its output, so an agent that dies or
restarts loses nothing: the worker keeps running and logging, and its exit status waits in the status
file for the agent's next life, which finds the shim by pid and start time in the allocation's record.

Signals: a stop signals the worker's process group, of which the shim is not a member. SIGTERM, SIGINT
and SIGHUP aimed at the shim itself (a `systemctl stop` of a whole cgroup, a terminal closing) are
ignored so that the worker's last output is still written; through handlers, not SIG_IGN, because an
ignored disposition would survive exec into the worker. The agent ends a stuck shim with SIGKILL.

Standard library and `logwriter` only: one runs per worker, so it must start fast and stay small.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TypedDict

from . import lease
from .logwriter import LineSplitter, RankLog

READ_CHUNK = 64 * 1024
# The umask of every worker and of the shim: what they create is their owner's alone unless they say so.
UMASK = 0o077
# Spec uid/gid of a worker that runs as the shim's own user.
SAME_USER = -1
# prctl(2), looked up before any fork (a worker's child calls it between fork and exec).
_PR_SET_NO_NEW_PRIVS = 38
_prctl = ctypes.CDLL(None, use_errno=True).prctl
COMMIT = b"commit\n"
# Without pidfds (Linux < 5.3), how often the shim looks whether the worker has ended.
POLL_S = 0.1
# How often the shim looks at the agent's lease (the worker fence, `lease.py`).
LEASE_CHECK_S = 0.25


class Spec(TypedDict):
    command: list[str]
    env: dict[str, str]
    cwd: str
    # CPUs to bind the worker to; empty: leave the affinity the shim inherited.
    cpus: list[int]
    log_path: str
    max_bytes: int
    backups: int
    status_path: str
    drain_timeout_s: float
    # The agent's lease (`lease.py`); "" for none. When it runs out, the worker is killed.
    lease_path: str
    # The identity the worker runs as (no supplementary groups); SAME_USER: the shim's own.
    uid: int
    gid: int


# --- the status file, shared with the agent ------------------------------------------------------------


def write_status(path: Path, returncode: int, exited_at: float) -> None:
    """Record the worker's end: `returncode` as Popen gives it (negative: killed by that signal)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"returncode": returncode, "exited_at": exited_at}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_status(path: Path) -> tuple[int, float] | None:
    """(returncode, exited_at) as the shim recorded them; None when it did not (or the file is damaged)."""
    try:
        data = json.loads(path.read_text())
        return int(data["returncode"]), float(data["exited_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- the shim process ----------------------------------------------------------------------------------


def parse_spec(raw: bytes) -> Spec:
    """The spec the agent sent; ValueError naming the first problem."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("the spec is not a JSON object")
    command, env, cpus = data.get("command"), data.get("env"), data.get("cpus")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
        raise ValueError("command must be a non-empty list of non-empty strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must map strings to strings")
    if not isinstance(cpus, list) or not all(isinstance(c, int) and c >= 0 for c in cpus):
        raise ValueError("cpus must be a list of CPU numbers >= 0")
    for key in ("cwd", "log_path", "status_path"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ValueError(f"{key} must be a non-empty string")
    if not isinstance(data.get("lease_path", ""), str):
        raise ValueError("lease_path must be a string")
    for key in ("max_bytes", "backups"):
        if not isinstance(data.get(key), int) or data[key] < 0:
            raise ValueError(f"{key} must be an integer >= 0")
    if not isinstance(data.get("drain_timeout_s"), int | float) or data["drain_timeout_s"] < 0:
        raise ValueError("drain_timeout_s must be a number >= 0")
    uid, gid = data.get("uid", SAME_USER), data.get("gid", SAME_USER)
    if not all(isinstance(x, int) and x >= SAME_USER for x in (uid, gid)) or (uid == SAME_USER) != (gid == SAME_USER):
        raise ValueError(f"uid and gid must both be ids >= 0, or both {SAME_USER}")
    return Spec(command=command, env=env, cwd=data["cwd"], cpus=cpus, log_path=data["log_path"],
                max_bytes=data["max_bytes"], backups=data["backups"], status_path=data["status_path"],
                drain_timeout_s=float(data["drain_timeout_s"]), lease_path=data.get("lease_path", ""),
                uid=uid, gid=gid)


class _Output:
    """The rank log, kept writable: a full or failing disk loses lines, never the worker (the pipes are
    drained either way, or the worker would block on its next print), and the loss is noted once it ends."""

    def __init__(self, log: RankLog) -> None:
        self.log = log
        self.lost = 0
        self._error = ""

    def write(self, stream: str, lines: list[bytes]) -> None:
        if not lines:
            return
        written = 0
        try:
            if self.lost:
                self.log.write("agent", f"[{self.lost} lines lost: cannot write {self.log.path} "
                                        f"({self._error})]".encode())
                self.lost = 0
            for line in lines:
                self.log.write(stream, line)
                written += 1
        except (OSError, ValueError) as exc:  # ValueError: the file could not be reopened after a rotation
            if not self.lost:
                _complain(f"cannot write {self.log.path}: {exc}; output is dropped until it is writable")
            self.lost += len(lines) - written
            self._error = str(exc)

    def flush(self) -> None:
        try:
            self.log.flush()
        except (OSError, ValueError) as exc:
            _complain(f"cannot write {self.log.path}: {exc}")


def _complain(message: str) -> None:
    # stderr is the rank's `.shim.err` file, opened by the agent.
    print(f"trainyard shim: {message}", file=sys.stderr, flush=True)


def _answer(reply: dict[str, object]) -> bool:
    """Send the answer; False if the agent's end of the pipe is gone."""
    try:
        os.write(1, json.dumps(reply).encode() + b"\n")
        return True
    except OSError:
        return False
    finally:
        _detach(1)


def _detach(fd: int) -> None:
    """Point `fd` (a pipe from or to the agent) at /dev/null: the agent's end sees it closed, and an agent
    that died makes no later read or write fail."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, fd)
    os.close(devnull)


def _read_line(fd: int) -> tuple[bytes, bytes]:
    """(first line without its newline, what followed it) from a raw fd: Python's buffered stdin could
    swallow bytes that `select` on the fd then never reports."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


def _ended(pid: int) -> bool:
    """Whether the worker has ended, without reaping it (its zombie keeps its pid and group id taken)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _reap(proc: subprocess.Popen[bytes]) -> int:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the rest of its group: dataloader workers, shell pipelines, ...
    except (ProcessLookupError, PermissionError):
        pass
    return proc.wait()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None  # no pidfd support: poll


class _Control:
    """The agent's side of the launch: stdin, on which COMMIT comes, or the end of the agent."""

    def __init__(self, pending: bytes) -> None:
        self.data = pending

    def decide(self) -> bool | None:
        """True once committed, False on anything else, None while what came so far may still be COMMIT."""
        if self.data.startswith(COMMIT):
            return True
        return None if COMMIT.startswith(self.data) else False

    def feed(self, chunk: bytes) -> bool | None:
        """`decide()` after `chunk`; an empty chunk is the end of stdin: the agent is gone."""
        self.data += chunk
        decided = self.decide()
        return decided if chunk or decided is not None else False


def _pump(proc: subprocess.Popen[bytes], out: _Output, fds: dict[int, str], control: _Control,
          drain_timeout_s: float, lease_path: str = "") -> tuple[int, float]:
    """Copy the worker's output to its log until it has ended and its pipes are closed (or the drain time
    is up); returns its returncode and when it ended. Kills the worker if the launch is not committed, or
    when the agent's lease at `lease_path` runs out (the worker fence)."""
    fence = Path(lease_path) if lease_path else None
    fenced = False
    next_check = 0.0
    sel = selectors.DefaultSelector()
    splitters = {fd: LineSplitter(out.log.max_line) for fd in fds}
    for fd in fds:
        sel.register(fd, selectors.EVENT_READ)
    decided = control.decide()
    if decided is None:
        sel.register(0, selectors.EVENT_READ)
    else:
        _detach(0)
        if not decided:
            _abort(proc, out)
    pidfd = _pidfd(proc.pid)
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ)
    returncode: int | None = None
    exited_at = 0.0
    deadline: float | None = None
    while fds:
        if deadline is not None:
            timeout: float | None = max(0.0, deadline - time.monotonic())
        else:
            timeout = POLL_S if pidfd is None else None
        if fence is not None and not fenced and returncode is None:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + LEASE_CHECK_S
                if lease.expired(fence):
                    fenced = True
                    _fence(proc, out)
            timeout = LEASE_CHECK_S if timeout is None else min(timeout, LEASE_CHECK_S)
        for key, _ in sel.select(timeout):
            fd = key.fd
            if fd == pidfd:
                sel.unregister(pidfd)
                os.close(pidfd)
                pidfd = None
                continue
            if fd == 0:
                decided = control.feed(os.read(0, 64))
                if decided is not None:
                    sel.unregister(0)
                    _detach(0)
                    if not decided:
                        _abort(proc, out)
                continue
            chunk = os.read(fd, READ_CHUNK)
            stream = fds[fd]
            if chunk:
                out.write(stream, splitters[fd].feed(chunk))
            else:
                out.write(stream, splitters[fd].finish())
                sel.unregister(fd)
                os.close(fd)
                del fds[fd]
        out.flush()
        if returncode is None and _ended(proc.pid):
            returncode, exited_at = _reap(proc), time.time()
            deadline = time.monotonic() + drain_timeout_s
        elif deadline is not None and time.monotonic() >= deadline:
            for fd, stream in fds.items():
                out.write(stream, splitters[fd].finish())
            out.write("agent", [b"[output still open after the worker ended (a process that left its group "
                                b"holds it?); the rest is not kept]"])
            out.flush()
            break
    if pidfd is not None:
        os.close(pidfd)
    sel.close()
    if decided is None and returncode is None:
        # Output closed before the agent decided, and the worker lives on: the answer still matters.
        while decided is None:
            decided = control.feed(os.read(0, 64))
        if not decided:
            _abort(proc, out)
    if returncode is None:
        # Both pipes closed while the worker still runs (it closed them itself): wait for its end.
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        returncode, exited_at = _reap(proc), time.time()
    return returncode, exited_at


def _fence(proc: subprocess.Popen[bytes], out: _Output) -> None:
    out.write("agent", [b"[the node's agent has not heard from the scheduler leader for longer than the worker "
                        b"fence (it died or lost contact); the scheduler restarts this job elsewhere, so this "
                        b"worker is killed]"])
    out.flush()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _abort(proc: subprocess.Popen[bytes], out: _Output) -> None:
    out.write("agent", [b"[the launch did not complete (another worker could not start, or the agent went "
                        b"away); this worker is killed]"])
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(spec: Spec, control: _Control) -> int:
    try:
        log = RankLog(Path(spec["log_path"]), max_bytes=spec["max_bytes"], backups=spec["backups"])
    except (OSError, ValueError) as exc:
        # Not started: a worker whose output could not be kept would run blind.
        _answer({"error": f"cannot open the log {spec['log_path']}: {exc}"})
        return 3
    out = _Output(log)
    if spec["cpus"]:
        try:
            os.sched_setaffinity(0, spec["cpus"])
        except OSError as exc:
            # The agent checked the CPUs against its own affinity; a cpuset changed since then. Run unbound.
            out.write("agent", [f"[not bound to CPUs {spec['cpus']}: {exc.strerror}]".encode()])
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # Set in the child after fork, before exec (setgroups, setregid, setreuid: real and effective ids both,
    # so nothing is left to switch back to); from root this also drops every capability. Popen's own cwd is
    # entered before the ids change, as root: a worker of another uid enters it after, as itself (preexec_fn
    # runs after the switch; the shim has no threads, so it is safe here), and a directory its uid may not
    # enter is refused instead of handed over.
    other = spec["uid"] != SAME_USER
    cwd = spec["cwd"]

    def as_the_team() -> None:
        os.chdir(cwd)
        # no_new_privs: no exec of the worker or its children gains privileges (a set-uid or file-capability
        # program on the host runs with the worker's own), for good; it cannot be unset.
        if _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")

    try:
        proc = subprocess.Popen(spec["command"], stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                                cwd=None if other else cwd, env=spec["env"], start_new_session=True, umask=UMASK,
                                user=spec["uid"] if other else None, group=spec["gid"] if other else None,
                                extra_groups=[] if other else None, preexec_fn=as_the_team if other else None)
    except OSError as exc:
        _answer({"exec_error": exc.strerror or str(exc)})
        return 3
    except subprocess.SubprocessError:
        # Only the chdir (and prctl, which does not fail on Linux ≥ 3.5) runs in preexec_fn; Popen reports its
        # failure without the errno.
        _answer({"exec_error": f"uid {spec['uid']} may not enter the working directory"})
        return 3
    finally:
        os.close(out_w)
        os.close(err_w)
    if not _answer({"pid": proc.pid}):
        control.data = b"-"  # nobody learns of this worker: no commit will come
    returncode, exited_at = _pump(proc, out, {out_r: "stdout", err_r: "stderr"}, control, spec["drain_timeout_s"],
                                  spec.get("lease_path", ""))
    out.log.close()
    write_status(Path(spec["status_path"]), returncode, exited_at)
    return 0


def main() -> int:
    os.umask(UMASK)  # the log and the status file: the agent's alone
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)
    line, rest = _read_line(0)
    try:
        spec = parse_spec(line)
    except ValueError as exc:
        _answer({"error": f"bad shim spec: {exc}"})
        return 2
    try:
        return run(spec, _Control(rest))
    except OSError as exc:
        # Before the answer the agent reports this; after it, the agent finds no status file and says so.
        _complain(f"{type(exc).__name__}: {exc}")
        _answer({"error": str(exc)})
        return 4


if __name__ == "__main__":
    sys.exit(main())
