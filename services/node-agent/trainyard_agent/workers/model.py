"""Worker domain types and the validation of a launch that needs no node state."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from trainyard_core.contract import TEAM
from trainyard_core.errors import InvalidArgument

# Job ids become directory names: no separators, no leading dot, bounded length.
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# exit_code of a worker that ended while no agent watched it: its real status cannot be known.
EXIT_UNKNOWN = -1


class RestartPolicy(enum.StrEnum):
    """What a restarted agent does with the workers of its previous life that still run."""

    # Keep them running and supervise them again: they are reported as running, and their exits later.
    ADOPT = "adopt"
    # Stop them (SIGTERM, grace, SIGKILL) and report their exits.
    STOP = "stop"

    @classmethod
    def parse(cls, value: str) -> RestartPolicy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"restart policy {value!r} is unknown; use one of: "
                             f"{', '.join(p.value for p in cls)}") from None


class Stream(enum.StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local_rank: int
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class LaunchRequest:
    job_id: str
    attempt: int
    command: tuple[str, ...]
    env: dict[str, str]
    working_dir: str
    workers: tuple[WorkerSpec, ...]
    leader_epoch: int = 0
    # The job's team ("" from a scheduler that does not send it): whose Unix identity the workers run as.
    team: str = ""

    def validate(self) -> None:
        """Checks that need no node state; raises InvalidArgument naming the problem."""
        check_job_id(self.job_id)
        if not TEAM.or_empty.matches(self.team):
            raise InvalidArgument(f"team {self.team!r} is invalid: use {TEAM.rule}")
        if self.attempt < 0:
            raise InvalidArgument(f"attempt must be >= 0, got {self.attempt}")
        if not self.command or not self.command[0]:
            raise InvalidArgument("command is empty: give the program to run, e.g. ['python', 'train.py']")
        if any("\0" in part for part in self.command):
            raise InvalidArgument("command contains a NUL byte")
        for key, value in self.env.items():
            if not _ENV_NAME_RE.match(key):
                raise InvalidArgument(f"env: {key!r} is not a valid environment variable name")
            if "\0" in value:
                raise InvalidArgument(f"env: value of {key} contains a NUL byte")
        if not self.workers:
            raise InvalidArgument("workers is empty: a launch starts at least one worker")
        ranks = [w.rank for w in self.workers]
        local_ranks = [w.local_rank for w in self.workers]
        if min(ranks) < 0 or min(local_ranks) < 0:
            raise InvalidArgument("ranks and local ranks must be >= 0")
        if len(set(ranks)) != len(ranks):
            raise InvalidArgument(f"duplicate ranks in workers: {sorted(ranks)}")
        if len(set(local_ranks)) != len(local_ranks):
            raise InvalidArgument(f"duplicate local ranks in workers: {sorted(local_ranks)}")
        seen: dict[int, int] = {}
        for w in self.workers:
            for gpu in w.gpu_indices:
                if gpu in seen:
                    raise InvalidArgument(f"GPU {gpu} is given to rank {seen[gpu]} and rank {w.rank}")
                seen[gpu] = w.rank


def check_job_id(job_id: str) -> None:
    if not _JOB_ID_RE.match(job_id):
        raise InvalidArgument(f"job_id {job_id!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit")


@dataclass(frozen=True)
class LaunchResult:
    pids: tuple[int, ...]
    already_running: bool


@dataclass(frozen=True)
class WorkerExit:
    """A worker ended. `signal` is the signal that killed it (0 if it exited by itself); a killed worker
    has exit_code 128 + signal (the shell's convention), so a non-zero exit code always means failure."""

    job_id: str
    attempt: int
    rank: int
    exit_code: int
    signal: int
    exited_at: float
    # The agent ended it as the agent shut down with its workers (`Supervisor.close(kill=True)`): the host went
    # away under the job, which the scheduler restarts it for.
    agent_shutdown: bool = False

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job_id, self.attempt, self.rank)


@dataclass(frozen=True)
class WorkerStatus:
    job_id: str
    attempt: int
    rank: int
    pid: int
    running: bool
    exit_code: int = 0
    signal: int = 0


@dataclass(frozen=True)
class LogLine:
    rank: int
    stream: str
    text: str
    attempt: int
    seq: int = 0  # the line's number in its (attempt, rank), from 1; 0 for the agent's own notes in an answer
    time_ms: int = 0  # when it was written (unix ms); 0: unknown (a file of the old format)


@dataclass
class LogQuery:
    job_id: str
    attempt: int = 0  # 0: every attempt on this node
    tail_lines: int = 0  # 0: every retained line (else: of the lines selected by the fields below)
    since_ms: int = 0  # 0: every line; else those written at or after (unix ms), and those of unknown time
    after_seq: dict[int, int] = field(default_factory=dict)  # rank → only its lines after that seq


def exit_status(returncode: int) -> tuple[int, int]:
    """(exit_code, signal) from a Popen returncode (negative: killed by that signal)."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, 0
