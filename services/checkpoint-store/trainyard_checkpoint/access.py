"""Who may act on which job's checkpoints: the checkpoint-store's binding of the authorization table's
`as_job` rules (`trainyard_core.security.authz`), the one place these checks live.

The table has already admitted the caller's kind to the method; this decides on the job the request names
(a job id, or a checkpoint id resolved here to its job and the attempt that began it):

- `trainyard://scheduler`: any job;
- `trainyard://job/<id>` (a worker credential): its own job only (else PERMISSION_DENIED naming both jobs);
  Begin only for the attempt its certificate names, Commit and Abort only on checkpoints that attempt began;
- gateway, tool: the jobs of the team named in the `x-trainyard-team` metadata (required; a tool only a team
  the store's `tool_teams` setting binds it to, else PERMISSION_DENIED); another team's job, or one with no
  team recorded, is NOT_FOUND, as if absent.

A job's team is what its worker credential says (the scheduler puts the job's team in the certificate):
the first call of a job's credential records it (`checkpoint-teams/<job_id>`, written once), so the
gateway's and tools' calls can be bound to it. Jobs that never called with a credential (checkpoints made
before, or by the scheduler or a tool) have no team and are visible to the scheduler only.

`decide` is pure; `CheckpointAccess` loads what it needs (cached: a checkpoint's job and attempt, and a
job's recorded team, never change) and calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from trainyard_core import contract
from trainyard_core.errors import InvalidArgument, NotFound, PermissionDenied
from trainyard_core.security.authz import JobRef
from trainyard_core.security.tls import PeerIdentity

from .domain.validation import validate_checkpoint_id, validate_job_id
from .repository import CheckpointRepository

V = TypeVar("V")
TEAM_HEADER = "x-trainyard-team"
TEAM_BOUND = frozenset({"gateway", "tool"})


@dataclass(frozen=True, slots=True)
class Target:
    """What the request acts on, as found: the job, its recorded team ("" none), and for a checkpoint id the
    attempt that began that checkpoint."""

    job_id: str
    team: str
    checkpoint_id: str = ""
    attempt: int | None = None


def caller_team(caller: PeerIdentity, method: str, metadata: Mapping[str, str],
                tool_teams: Mapping[str, frozenset[str]]) -> str:
    """The team a gateway or tool call acts for: InvalidArgument when the header is missing or malformed,
    PermissionDenied when a tool names a team it is not bound to (the gateway is trusted with its users')."""
    team = metadata.get(TEAM_HEADER, "")
    if not team:
        raise InvalidArgument(f"{method} from {caller.principal} must name the team it acts for in the "
                              f"{TEAM_HEADER} metadata")
    if not contract.TEAM.matches(team):
        raise InvalidArgument(f"{TEAM_HEADER} {team!r} is not a team: expected {contract.TEAM.rule}")
    if caller.principal.kind == "tool":
        bound = tool_teams.get(caller.principal.name, frozenset())
        if team not in bound:
            allowed = ", ".join(sorted(bound)) or "none (the checkpoint-store's tool_teams binds tools to teams)"
            raise PermissionDenied(f"{caller.principal} may not act for team {team!r}; its teams: {allowed}")
    return team


def decide(caller: PeerIdentity, method: str, ref: JobRef, target: Target, team: str = "") -> None:
    """Raise unless `caller` may call `method` on `target` (`team`: the gateway's or tool's, from
    `caller_team`)."""
    principal = caller.principal
    if principal.kind == "scheduler":
        return
    if principal.kind == "job":
        grant = caller.grant
        if grant is None:  # tls.peer_identity gives every job principal its grant
            raise PermissionDenied(f"{principal} may not call {method}: its certificate grants nothing")
        if target.job_id != grant.job_id:
            raise PermissionDenied(f"{principal} may not call {method} for job {target.job_id}: a job's "
                                   f"credential reaches only the checkpoints of job {grant.job_id}")
        if ref.attempt is not None and ref.attempt != grant.attempt:
            raise PermissionDenied(f"{principal} may not call {method} for attempt {ref.attempt}: its "
                                   f"credential is attempt {grant.attempt}'s")
        if ref.same_attempt and target.attempt != grant.attempt:
            raise PermissionDenied(f"{principal} may not call {method} on checkpoint {target.checkpoint_id}: "
                                   f"attempt {target.attempt} began it, the credential is attempt "
                                   f"{grant.attempt}'s")
        if target.team and grant.team and target.team != grant.team:
            raise PermissionDenied(f"{principal} may not call {method}: job {target.job_id}'s checkpoints are "
                                   f"recorded for team {target.team}, the credential names team {grant.team}")
        return
    if principal.kind in TEAM_BOUND:
        if target.team != team:
            # The same answer as for a job or checkpoint that does not exist: nothing of it is shown.
            if target.checkpoint_id:
                raise NotFound(f"checkpoint {target.checkpoint_id} not found")
            raise NotFound(f"job {target.job_id} has no checkpoints visible to team {team}")
        return
    raise PermissionDenied(f"{principal} may not call {method}: no binding admits a {principal.kind} to a "
                           "job's checkpoints")


def _remember(cache: OrderedDict[str, V], key: str, value: V, limit: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


class CheckpointAccess:
    """The checkpoint-store's `authz.JobBinding`."""

    CACHE_MAX = 65_536

    def __init__(self, repo: CheckpointRepository, tool_teams: Mapping[str, frozenset[str]] | None = None) -> None:
        self._repo = repo
        self._tool_teams = tool_teams or {}
        self._checkpoints: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id → (job id, attempt)
        self._teams: OrderedDict[str, str] = OrderedDict()  # job id → recorded team

    async def _checkpoint(self, checkpoint_id: str) -> tuple[str, int]:
        found = self._checkpoints.get(checkpoint_id)
        if found is not None:
            return found
        stored = await self._repo.load(checkpoint_id)
        if stored is None:
            raise NotFound(f"checkpoint {checkpoint_id} not found")
        found = (stored.checkpoint.job_id, stored.checkpoint.attempt)
        _remember(self._checkpoints, checkpoint_id, found, self.CACHE_MAX)
        return found

    async def _team(self, job_id: str) -> str:
        team = self._teams.get(job_id)
        if team is None:
            recorded = await self._repo.job_team(job_id)
            if recorded is None:
                return ""  # not cached: the job's first credential call records it
            team = recorded
            _remember(self._teams, job_id, team, self.CACHE_MAX)
        return team

    async def target(self, ref: JobRef) -> Target:
        """What `ref` names, as found; InvalidArgument for a malformed or missing id (the same message the
        servicer would give), NotFound for a checkpoint id that names none."""
        if ref.checkpoint_id is not None:
            validate_checkpoint_id(ref.checkpoint_id)
            job_id, attempt = await self._checkpoint(ref.checkpoint_id)
            return Target(job_id, await self._team(job_id), ref.checkpoint_id, attempt)
        job_id = ref.job_id or ""
        validate_job_id(job_id)
        return Target(job_id, await self._team(job_id))

    async def bind(self, caller: PeerIdentity, method: str, ref: JobRef, metadata: Mapping[str, str]) -> None:
        kind = caller.principal.kind
        if kind == "scheduler":
            return  # any job: nothing to look up
        team = caller_team(caller, method, metadata, self._tool_teams) if kind in TEAM_BOUND else ""
        target = await self.target(ref)
        decide(caller, method, ref, target, team)
        grant = caller.grant
        if kind == "job" and grant is not None and grant.team and not target.team:
            recorded = await self._repo.record_team(target.job_id, grant.team)
            _remember(self._teams, target.job_id, recorded, self.CACHE_MAX)
            decide(caller, method, ref, Target(target.job_id, recorded, target.checkpoint_id, target.attempt))
