"""Commands run as another account from a test process, without forking it.

CPython's `subprocess` forks instead of vforking when `user=`, `group=` or `extra_groups=` is given, and a fork of
a process whose gRPC threads are running (any test process after a test that used gRPC) runs gRPC's fork handlers
in the child, which can crash it before it executes the command (seen in CI: `ls` dying of SIGSEGV with an
`epoll_wait error: Bad file descriptor`). setpriv(1) changes the ids after the exec instead, so the test process
takes the vfork path. The agent's shim is its own process without gRPC, so it keeps `Popen(user=...)`.

setpriv's own exec of the command still resolves its path with root's capabilities (a program under a directory
the account may not search starts anyway), so setpriv executes env(1), whose exec of the command is the
account's alone: what the account may not start fails here as it would under `Popen(user=...)`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


def as_account(uid: int, gid: int, argv: Sequence[str]) -> list[str]:
    """`argv` to run as `uid`:`gid` with no supplementary groups (none of root's linger)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", "env", "--", *argv]


def run_as(uid: int, gid: int, *argv: str, timeout: float = 30, cwd: str | None = None,
           ) -> subprocess.CompletedProcess[str]:
    """Run `argv` as `uid`:`gid`, its output captured as text; the exit status is the caller's to check."""
    return subprocess.run(as_account(uid, gid, argv), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          check=False)
