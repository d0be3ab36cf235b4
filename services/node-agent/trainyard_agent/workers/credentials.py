"""The checkpoint-store credential of a job attempt's workers on this node: in files, not in their environment.

The scheduler sends an attempt's credential (`trainyard_core.security.job_credentials`: the job certificate
with the job issuer's, its key, the CA bundle; PEM) in the launch's env, TRAINYARD_CHECKPOINT_CERT/_KEY/_CA,
and again, renewed, with every `RenewJobCredential` while the attempt runs (the credential lives an hour by
default, and the leader renews it past half of that). A worker's environment cannot change under it, so the
agent writes the credential to three files and gives the workers their paths in the same variables; the
checkpoint client re-reads the files when they change (`trainyard_checkpoint.client.credentials`). The key
is then in no process's environment (/proc/<pid>/environ) and in no shim's spec.

Where: `<workdir_root>/<job_id>/.trainyard/checkpoint-<attempt>.{cert,key,ca}.pem`, in the job's own
directory (`tenancy.job_workdir`, made for the team's identity even when the job names a working_dir of its
own: that one may be shared, these files must not be). The `.trainyard` directory is 0700 and the files
0600, both owned by the job directory's owner: the team's uid:gid when workers run as their team's identity,
the agent's own user when single-tenant. Nobody else can list or read them.

How, and why with directory descriptors: the job's directory belongs to the workers' uid, so a worker can
rename, replace or symlink anything in it, and the agent writing there runs as root. Every step below goes
through a descriptor of a directory opened with O_NOFOLLOW and checked (`<workdir_root>/<job_id>` itself
cannot be swapped: workdir_root is the agent's, mode 0711), never through a path a worker could redirect:
a file is created as a new temporary name (O_CREAT|O_EXCL|O_NOFOLLOW), chowned through its descriptor,
written, fsynced and renamed over the old one in the same directory. A reader sees the old file or the new
one, never a part. The three renames are three steps, so a reader can meet a new key beside the previous
certificate for a moment: the client checks that the key is the certificate's and reads again when it is not.

When: written at launch (and again for a retried launch of the running attempt, which may carry a newer
credential), replaced by each renewal, removed when the attempt's last worker on this node has ended.
Renewals and launches write one at a time (the supervisor's lock), so an older credential never lands
after a newer one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trainyard_core.errors import FailedPrecondition, InvalidArgument
from trainyard_core.security.job_credentials import (
    CA_ENV,
    CERT_ENV,
    CREDENTIAL_ENVS,
    KEY_ENV,
    InvalidCredential,
    JobGrant,
    check_credential,
    is_pem,
)

log = logging.getLogger(__name__)

DIR_NAME = ".trainyard"
DIR_MODE = 0o700
FILE_MODE = 0o600
# What each variable names, in the order they are replaced (see the module docstring).
_FILES = ((CA_ENV, "ca"), (KEY_ENV, "key"), (CERT_ENV, "cert"))


@dataclass(frozen=True, slots=True)
class Credential:
    """A job attempt's credential as it reaches the agent (PEM). Never logged: repr shows none of it."""

    cert_chain: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)

    def check(self, job_id: str, attempt: int, now: float) -> JobGrant:
        """InvalidArgument unless this is a valid, unexpired credential of (job_id, attempt)."""
        try:
            return check_credential(self.cert_chain, self.key, self.ca, job_id=job_id, attempt=attempt,
                                    now=dt.datetime.fromtimestamp(now, dt.UTC))
        except InvalidCredential as exc:
            raise InvalidArgument(str(exc)) from None


def from_env(env: Mapping[str, str]) -> Credential | None:
    """The credential a launch's env carries as PEM; None when it carries none (a scheduler without a job
    issuer; or variables that already name files, which the workers get as they are). InvalidArgument for a
    credential given in part."""
    values = {name: env.get(name, "") for name in CREDENTIAL_ENVS}
    pem = [name for name, value in values.items() if is_pem(value)]
    if not pem:
        return None
    if len(pem) < len(CREDENTIAL_ENVS):
        missing = [name for name in CREDENTIAL_ENVS if name not in pem]
        raise InvalidArgument(f"env: {', '.join(pem)} hold PEM but {', '.join(missing)} do not: a checkpoint-store "
                              "credential is all three")
    return Credential(values[CERT_ENV].encode(), values[KEY_ENV].encode(), values[CA_ENV].encode())


def job_dir(workdir_root: Path, job_id: str) -> Path:
    return workdir_root / job_id


def paths(job_directory: Path, attempt: int) -> dict[str, str]:
    """The variables the workers of `attempt` get: each names its file."""
    base = job_directory / DIR_NAME
    return {name: str(base / _name(attempt, kind)) for name, kind in _FILES}


def _name(attempt: int, kind: str) -> str:
    return f"checkpoint-{attempt}.{kind}.pem"


def write(job_directory: Path, attempt: int, cred: Credential) -> None:
    """Replace the files of `attempt` in `job_directory` with `cred` (blocking: call it off the event loop).
    FailedPrecondition naming the directory when it cannot."""
    content = {"ca": cred.ca, "key": cred.key, "cert": cred.cert_chain}
    try:
        with _opened_dir(None, str(job_directory)) as jfd:
            owner = os.fstat(jfd)
            with _private_dir(jfd, owner.st_uid, owner.st_gid) as cfd:
                for _, kind in _FILES:
                    _replace(cfd, _name(attempt, kind), content[kind], owner.st_uid, owner.st_gid)
                os.fsync(cfd)  # the renames are durable: an agent restart finds the credential it answered for
    except OSError as exc:
        raise FailedPrecondition(f"cannot write the checkpoint-store credential under {job_directory}/{DIR_NAME}: "
                                 f"{exc.strerror or exc}") from exc


def remove(job_directory: Path, attempt: int) -> None:
    """Remove the files of `attempt` (its workers have ended); what cannot be removed is logged."""
    try:
        with _opened_dir(None, str(job_directory)) as jfd, _opened_dir(jfd, DIR_NAME) as cfd:
            for _, kind in _FILES:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_name(attempt, kind), dir_fd=cfd)
    except FileNotFoundError:
        return  # never written (a launch without a credential), or removed with the job's directory
    except OSError as exc:
        log.warning("cannot remove the checkpoint-store credential of an ended attempt",
                    extra={"path": str(job_directory / DIR_NAME), "attempt": attempt, "error": exc.strerror})


@contextlib.contextmanager
def _opened_dir(dir_fd: int | None, name: str) -> Iterator[int]:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _private_dir(jfd: int, uid: int, gid: int) -> Iterator[int]:
    """`.trainyard` in the job's directory, 0700 and owned by uid:gid (made if missing, or made by the workers
    themselves). One of another owner is refused: it is not the workers'."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(DIR_NAME, DIR_MODE, dir_fd=jfd)
    with _opened_dir(jfd, DIR_NAME) as cfd:  # a symbolic link put there fails here (ELOOP), it is not followed
        st = os.fstat(cfd)
        if st.st_uid not in (uid, os.geteuid()):
            raise FailedPrecondition(f"{DIR_NAME} in the job's directory belongs to uid {st.st_uid}, not to the "
                                     f"workers' uid {uid}: remove it")
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(cfd, uid, gid)  # just made by the agent, for the workers
        if stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(cfd, DIR_MODE)
        yield cfd


def _replace(cfd: int, name: str, data: bytes, uid: int, gid: int) -> None:
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=cfd)
    try:
        try:
            if (uid, gid) != (os.geteuid(), os.getegid()):
                os.fchown(fd, uid, gid)
            os.fchmod(fd, FILE_MODE)  # whatever the umask left
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=cfd, dst_dir_fd=cfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=cfd)
        raise
