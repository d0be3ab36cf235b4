"""Who may do what through the gateway: one table, action → the least role it needs, the scope a scoped
token must hold for it, and whether it is confined to the caller's team. Routes name their action through
a dependency of `auth`; nothing else decides.

Roles (trainyard_core.contract.Role) are ordered: viewer < member < admin < operator. Team-scoped actions
act on the caller's own team, except for operators, who act on every team; other teams' objects are
invisible (404), not forbidden. A token with scopes may do an action only when its role allows it AND its
scopes hold the action's scope; a token without scopes is limited by its role alone.

Pure functions of a `Caller` (a token record): no I/O, so the table is tested directly and by the routes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from trainyard_core.contract import Role, Scope
from trainyard_core.errors import InvalidArgument, PermissionDenied


class Action(StrEnum):
    JOBS_READ = "jobs.read"  # list, get, logs
    JOBS_SUBMIT = "jobs.submit"
    JOBS_CANCEL = "jobs.cancel"  # the caller's own job
    JOBS_CANCEL_ANY = "jobs.cancel_any"  # a teammate's job too
    JOBS_UPDATE = "jobs.update"  # hold, release, requeue, priority: the caller's own job
    JOBS_UPDATE_ANY = "jobs.update_any"  # a teammate's job too (and lifting a hold someone else placed)
    NODES_READ = "nodes.read"
    NODES_ADDRESSES = "nodes.addresses"  # hostnames and agent addresses in node answers
    NODES_WRITE = "nodes.write"  # cordon, uncordon, set GPU health
    QUEUES_READ = "queues.read"
    QUEUES_WRITE = "queues.write"
    QUOTAS_READ = "quotas.read"
    QUOTAS_WRITE = "quotas.write"
    TOKENS_READ = "tokens.read"
    TOKENS_WRITE = "tokens.write"  # create, revoke
    AUDIT_READ = "audit.read"
    USAGE_READ = "usage.read"  # GPU-hours, CPU-hours and cost (GET /v1/usage)
    CHECKPOINTS_READ = "checkpoints.read"  # a job's checkpoints: list, get, manifest
    CHECKPOINTS_WRITE = "checkpoints.write"  # tag, untag, delete: the caller's own job's
    CHECKPOINTS_WRITE_ANY = "checkpoints.write_any"  # a teammate's job's too


@dataclass(frozen=True, slots=True)
class Rule:
    role: Role
    scope: Scope
    team_scoped: bool


_V, _M, _A, _O = Role.VIEWER, Role.MEMBER, Role.ADMIN, Role.OPERATOR
RULES: dict[Action, Rule] = {
    Action.JOBS_READ: Rule(_V, Scope.JOBS_READ, team_scoped=True),
    Action.JOBS_SUBMIT: Rule(_M, Scope.JOBS_WRITE, team_scoped=True),
    Action.JOBS_CANCEL: Rule(_M, Scope.JOBS_WRITE, team_scoped=True),
    Action.JOBS_CANCEL_ANY: Rule(_A, Scope.JOBS_WRITE, team_scoped=True),
    Action.JOBS_UPDATE: Rule(_M, Scope.JOBS_WRITE, team_scoped=True),
    Action.JOBS_UPDATE_ANY: Rule(_A, Scope.JOBS_WRITE, team_scoped=True),
    Action.NODES_READ: Rule(_V, Scope.NODES_READ, team_scoped=False),
    Action.NODES_ADDRESSES: Rule(_O, Scope.NODES_READ, team_scoped=False),
    Action.NODES_WRITE: Rule(_O, Scope.NODES_WRITE, team_scoped=False),
    Action.QUEUES_READ: Rule(_V, Scope.QUEUES_READ, team_scoped=False),
    Action.QUEUES_WRITE: Rule(_O, Scope.QUEUES_WRITE, team_scoped=False),
    Action.QUOTAS_READ: Rule(_V, Scope.QUOTAS_READ, team_scoped=True),
    Action.QUOTAS_WRITE: Rule(_O, Scope.QUOTAS_WRITE, team_scoped=False),
    Action.TOKENS_READ: Rule(_A, Scope.TOKENS_READ, team_scoped=True),
    Action.TOKENS_WRITE: Rule(_A, Scope.TOKENS_WRITE, team_scoped=True),
    Action.AUDIT_READ: Rule(_O, Scope.AUDIT_READ, team_scoped=False),
    # A team's usage and cost: every role of the team reads its own; operators every team's.
    Action.USAGE_READ: Rule(_V, Scope.USAGE_READ, team_scoped=True),
    # A checkpoint is the job's data: read with the job, changed like the job (cancel's roles and scope).
    Action.CHECKPOINTS_READ: Rule(_V, Scope.JOBS_READ, team_scoped=True),
    Action.CHECKPOINTS_WRITE: Rule(_M, Scope.JOBS_WRITE, team_scoped=True),
    Action.CHECKPOINTS_WRITE_ANY: Rule(_A, Scope.JOBS_WRITE, team_scoped=True),
}
# The highest role a team admin may grant; operators grant any.
MAX_ROLE_GRANTED_BY_ADMIN = Role.ADMIN


class Caller(Protocol):
    @property
    def team(self) -> str: ...
    @property
    def user(self) -> str: ...
    @property
    def role(self) -> Role: ...
    @property
    def scopes(self) -> tuple[Scope, ...]: ...


def refusal(caller: Caller, action: Action) -> str:
    """Why `caller` may not do `action`; '' when it may."""
    rule = RULES[action]
    if not caller.role.at_least(rule.role):
        return (f"{action.value} needs the {rule.role.value} role or higher; the token of {caller.user} (team "
                f"{caller.team}) has the {caller.role.value} role")
    if caller.scopes and rule.scope not in caller.scopes:
        return (f"{action.value} needs the scope {rule.scope.value}; the token of {caller.user} is limited to "
                f"{', '.join(s.value for s in caller.scopes)}")
    return ""


def allows(caller: Caller, action: Action) -> bool:
    return not refusal(caller, action)


def check(caller: Caller, action: Action) -> None:
    """PermissionDenied naming the role or scope that is missing."""
    why = refusal(caller, action)
    if why:
        raise PermissionDenied(why)


def team_filter(caller: Caller, action: Action) -> str:
    """The team the action is confined to: '' (every team) for operators and cluster-wide actions, else
    the caller's own team."""
    if not RULES[action].team_scoped or caller.role is Role.OPERATOR:
        return ""
    return caller.team


def sees_team(caller: Caller, action: Action, team: str) -> bool:
    scope = team_filter(caller, action)
    return not scope or scope == team


def parse_role(value: str) -> Role:
    try:
        return Role(value)
    except ValueError:
        raise InvalidArgument(f"role must be one of {', '.join(r.value for r in Role)} (got {value[:40]!r})") \
            from None


def parse_scopes(values: Collection[str]) -> tuple[Scope, ...]:
    """Known scope names, deduplicated, in the vocabulary's order; InvalidArgument naming an unknown one."""
    known = {s.value: s for s in Scope}
    unknown = [v for v in values if v not in known]
    if unknown:
        raise InvalidArgument(f"unknown scope {unknown[0][:40]!r}; scopes are {', '.join(known)}")
    wanted = set(values)
    return tuple(s for s in Scope if s.value in wanted)


def check_grant(creator: Caller, *, team: str, role: Role, scopes: tuple[Scope, ...]) -> None:
    """May `creator` (who holds tokens.write) mint a token for `team` with `role` and `scopes`? Team admins
    mint for their own team and up to admin; a scoped creator only tokens as narrow as itself (never an
    unscoped one), so no token widens what its creator may do."""
    if creator.role is not Role.OPERATOR:
        if team != creator.team:
            raise PermissionDenied(f"a team admin may create tokens only for its own team ({creator.team}), not "
                                   f"for {team}")
        if not MAX_ROLE_GRANTED_BY_ADMIN.at_least(role):
            raise PermissionDenied(f"a team admin may grant roles up to {MAX_ROLE_GRANTED_BY_ADMIN.value}, not "
                                   f"{role.value}")
    if creator.scopes:
        wider = [s.value for s in scopes if s not in creator.scopes] if scopes else ["(no scopes: everything)"]
        if wider:
            raise PermissionDenied(f"a token limited to {', '.join(s.value for s in creator.scopes)} may create "
                                   f"only tokens within those scopes; asked for {', '.join(wider)}")


def check_cancel(caller: Caller, job_user: str) -> None:
    """After JOBS_CANCEL and the team check: a job of someone else needs JOBS_CANCEL_ANY. The job exists for
    the caller (it is its team's), so this is 403, not 404."""
    if job_user != caller.user and not allows(caller, Action.JOBS_CANCEL_ANY):
        raise PermissionDenied(f"only the job's submitter or a team admin may cancel it (submitted by {job_user}; "
                               f"the token of {caller.user} has the {caller.role.value} role)")


def check_update(caller: Caller, job_user: str, verb: str) -> None:
    """After JOBS_UPDATE and the team check (hold, release, requeue, priority change): a job of someone else
    needs JOBS_UPDATE_ANY (403, not 404: the job is the caller's team's)."""
    if job_user != caller.user and not allows(caller, Action.JOBS_UPDATE_ANY):
        raise PermissionDenied(f"only the job's submitter or a team admin may {verb} it (submitted by {job_user}; "
                               f"the token of {caller.user} has the {caller.role.value} role)")


def check_release(caller: Caller, job_user: str, held_by: str) -> None:
    """A hold is lifted by whoever placed it, or by a team admin (an admin's hold on a member's job stays until an
    admin lifts it, as Slurm's administrator holds do)."""
    check_update(caller, job_user, "release")
    if held_by and held_by != caller.user and not allows(caller, Action.JOBS_UPDATE_ANY):
        raise PermissionDenied(f"the job is held by {held_by}: only they or a team admin may release it (the token "
                               f"of {caller.user} has the {caller.role.value} role)")


def check_checkpoint_write(caller: Caller, job_user: str) -> None:
    """After CHECKPOINTS_WRITE and the team check: tagging, untagging or deleting the checkpoints of someone
    else's job needs CHECKPOINTS_WRITE_ANY (a team admin; operators hold it for every team). 403, not 404: the
    job is the caller's team's."""
    if job_user != caller.user and not allows(caller, Action.CHECKPOINTS_WRITE_ANY):
        raise PermissionDenied(f"only the job's submitter or a team admin may tag, untag or delete its checkpoints "
                               f"(submitted by {job_user}; the token of {caller.user} has the {caller.role.value} "
                               "role)")
