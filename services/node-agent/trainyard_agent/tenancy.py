"""Tenants apart on the host: the Unix identity each team's workers run as, and the directories they get.

Without this every worker would run as the agent's user, where one team's job can read another's files,
logs, environment (tokens, credentials) and memory, and signal its processes. With `run_as` every team
has a uid:gid of its own, and the kernel keeps them apart: files by their owner and mode, /proc/<pid>
(environ, fds, memory) and signals by the uid of the process.

Who runs as whom, and why (`shim.py` starts the worker):

- The agent and the shims run as root. The shim drops to the team's uid and gid, with no supplementary
  groups and umask 077, only in the worker's child process, right before it executes the worker
  (`subprocess.Popen(user=, group=, extra_groups=[], umask=)`). The shim stays root because it holds
  what the worker must not touch: its stdin is the agent's control pipe (COMMIT), it writes the worker's
  log and its exit status, and it reads the agent's lease. A shim running as the team's uid could be
  ptraced, signalled or have its files rewritten by its own worker: a worker could then forge its exit
  status (report success after a crash), rewrite or delete its log, or keep running past the fence.
  Running as root, its memory, its fds (/proc/<shim>/fd/0, the control pipe) and its files are out of the
  worker's reach, and it can still kill the worker's process group, as the agent can.
- Logs, exit status files, shim error files and records live under `<state_dir>/jobs`, owned by the agent,
  directories 0700 and files 0600: no worker reads or writes them, its own included (its output reaches
  its log through the shim's pipe; GetWorkerLogs serves it).
- The job's working directory is `<workdir_root>/<job_id>`, made by the agent and handed to the team's
  uid:gid with mode 0700. `workdir_root` is the agent's, mode 0711: others may pass through it to their
  own directory, but not list it (no job ids of other teams) or replace an entry. Every directory above
  it must be searchable by others, or a worker could not open a path of its own working directory by its
  absolute name; the agent checks that at start. A job's own `working_dir` is entered by the worker's
  child after the switch, as the team's uid: one that uid may not enter is refused (INVALID_ARGUMENT).
- Staging of async checkpoints (`trainyard_checkpoint.client.staging`) is an anonymous memfd handed to the
  saver process over a socketpair: no path exists; /proc/<pid>/fd of the job's processes is readable by
  its uid only.

Why root and not capabilities: an agent of another uid holding CAP_SETUID/CAP_SETGID passes them to its
shims only as ambient capabilities (they are lost at exec otherwise), and an ambient set survives a
change from one non-zero uid to another and the exec of the worker: the worker would hold CAP_SETUID
and could become anyone. Root, by contrast, loses every capability when it sets all of its uids to a
non-zero one. So a separating agent runs as root.

`single_tenant=true` keeps every worker as the agent's own user (one team per host, or the local
development cluster, where one person is every team); the agent says so with a warning at start. With
neither a mapping nor single_tenant the agent refuses to start: running teams together must be a choice.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The site mapping's parser is shared with the checkpoint-store; re-exported here for the agent's modules.
from trainyard_core.errors import FailedPrecondition
from trainyard_core.files import closed_parent
from trainyard_core.security.unix_ids import (
    MIN_ID,
    RUN_AS_EXAMPLE,
    Identity,
    check_run_as,
    parse_identity,
    read_run_as_file,
)

# workdir_root: others may pass through to their own job's directory, not list it.
SHARED_ROOT_MODE = 0o711
PRIVATE_MODE = 0o700


class TenancyError(FailedPrecondition):
    """The agent cannot keep teams apart as configured; the message says what to set."""


@dataclass(frozen=True)
class Tenancy:
    """Whose identity a team's workers run as. `single_tenant`: every worker as the agent's own user."""

    identities: Mapping[str, Identity]
    single_tenant: bool

    @classmethod
    def single(cls) -> Tenancy:
        return cls(identities={}, single_tenant=True)

    @classmethod
    def decide(cls, run_as: Mapping[str, str], *, single_tenant: bool, euid: int) -> Tenancy:
        """The tenancy of an agent running as `euid`; TenancyError saying what to set when there is none
        it can keep."""
        if single_tenant:
            if run_as:
                raise TenancyError("single_tenant=true and run_as exclude each other: set one or the other")
            return cls.single()
        if not run_as:
            raise TenancyError(
                f"no run_as mapping: every team's workers would run as the agent's own user (uid {euid}) and "
                "could read each other's files, logs and environment. Map each team to a Unix identity with "
                f"run_as ({RUN_AS_EXAMPLE}, or TRAINYARD_AGENT_RUN_AS=ml=2001:2001,research=2002:2002) or "
                "run_as_file (lines 'team uid:gid'); or set single_tenant=true to run them all as the "
                "agent's user (one team per host, or a development cluster)")
        try:
            identities = check_run_as(run_as)
        except ValueError as exc:
            raise TenancyError(str(exc)) from None
        if euid != 0:
            raise TenancyError(
                f"run_as needs the agent to run as root (it runs as uid {euid}): it starts each team's workers "
                "as that team's user and must keep the right to stop them. Run it as root (for the systemd "
                "unit, a drop-in with User=root and Group=root), or set single_tenant=true. Capabilities "
                "alone are not enough: docs/security.md, 'Tenants on the hosts', says why")
        # The agent's own uid (0) is below MIN_ID, so no team runs as the agent.
        return cls(identities=identities, single_tenant=False)

    def identity_for(self, team: str) -> Identity | None:
        """The identity `team`'s workers run as; None: the agent's own (single tenant). FailedPrecondition
        for a team this agent has no identity for."""
        if self.single_tenant:
            return None
        ident = self.identities.get(team)
        if ident is not None:
            return ident
        if not team:
            raise FailedPrecondition("the launch names no team (a scheduler older than this agent?), and this "
                                     "agent runs each team's workers as the team's own Unix user: upgrade the "
                                     "scheduler, or set single_tenant=true on the agent")
        raise FailedPrecondition(f"team {team!r} has no Unix identity on this node: add it to the agent's run_as "
                                 f"(e.g. --run-as {team}=<uid>:<gid>) or run_as_file")


# --- directories ------------------------------------------------------------------------------------------


def prepare_workdir_root(root: Path, *, shared: bool) -> None:
    """Create `root`, the parent of every job's working directory, owned by the agent: mode 0711 when
    workers run as other users (`shared`), who must also be able to pass through every directory above
    it, else 0700. TenancyError saying what to change."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_MODE)
        st = os.lstat(root)
    except OSError as exc:
        raise TenancyError(f"cannot create workdir_root {root}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise TenancyError(f"workdir_root {root} is not a directory (a symbolic link?): name a directory")
    if st.st_uid != os.geteuid():
        raise TenancyError(f"workdir_root {root} belongs to uid {st.st_uid}, not to the agent (uid {os.geteuid()}): "
                           "whoever owns it could swap one job's working directory for another's")
    os.chmod(root, SHARED_ROOT_MODE if shared else PRIVATE_MODE)
    if not shared:
        return
    closed = closed_parent(root)
    if closed is not None:
        parent, mode = closed
        raise TenancyError(
            f"workers cannot reach their working directories under workdir_root {root}: {parent} is mode "
            f"{mode:04o}, which other users may not pass through. Allow it (chmod o+x {parent}) or set "
            "workdir_root to a directory under parents they may pass (e.g. /var/lib/trainyard/work)")


def job_workdir(root: Path, job_id: str, ident: Identity | None) -> Path:
    """`<root>/<job_id>`, created 0700 for `ident` (None: the agent itself); an existing one must be a
    directory of that owner. Shared by the job's attempts, so a restarted attempt finds what the previous
    one left. FailedPrecondition when it cannot be made or belongs to someone else."""
    path = root / job_id
    uid = os.geteuid() if ident is None else ident.uid
    try:
        os.mkdir(path, PRIVATE_MODE)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise FailedPrecondition(f"cannot create the working directory {path}: {exc.strerror or exc}") from exc
    try:
        if created and ident is not None:
            # Made by the agent in a directory only the agent may write: nothing can be swapped in between.
            os.chown(path, ident.uid, ident.gid, follow_symlinks=False)
        st = os.lstat(path)
    except OSError as exc:
        raise FailedPrecondition(f"cannot hand the working directory {path} to uid {uid}: "
                                 f"{exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"the working directory {path} is not a directory")
    if st.st_uid != uid:
        raise FailedPrecondition(f"the working directory {path} belongs to uid {st.st_uid}, not to uid {uid} "
                                 "that this job runs as: remove it, or give the job a working_dir")
    return path


__all__ = ["MIN_ID", "Identity", "Tenancy", "TenancyError", "check_run_as", "job_workdir", "parse_identity",
           "prepare_workdir_root", "read_run_as_file"]
