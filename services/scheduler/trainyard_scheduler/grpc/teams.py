"""The team a call to the scheduler acts for, from its caller's principal: one rule for every servicer that
reads or writes a team's data (JobService, UsageService)."""

from __future__ import annotations

from collections.abc import Mapping

from trainyard_core.errors import PermissionDenied
from trainyard_core.security import authz


def acting_team(requested: str, tool_teams: Mapping[str, frozenset[str]]) -> str:
    """The team a call acts for (for reads, '' is every team). The gateway is trusted with its users' team; a
    tool acts only for the teams `tool_teams` (the scheduler's tool_teams setting) binds it to, and must name
    one. On a plaintext server (no principal) the request is taken as it is."""
    principal = authz.current_principal.get()
    if principal is None or principal.kind == "gateway":
        return requested
    bound = tool_teams.get(principal.name, frozenset()) if principal.kind == "tool" else frozenset()
    allowed = ", ".join(sorted(bound)) or "none (the scheduler's tool_teams setting binds tools to teams)"
    if not requested:
        raise PermissionDenied(f"{principal} must name the team it acts for; its teams: {allowed}")
    if requested not in bound:
        raise PermissionDenied(f"{principal} may not act for team {requested!r}; its teams: {allowed}")
    return requested
