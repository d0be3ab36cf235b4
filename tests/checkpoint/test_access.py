"""The checkpoint-store's job binding as a pure decision (`access.decide`, `access.caller_team`): one table of
callers, requests and what they find, and the answer each gets."""

from __future__ import annotations

import pytest

from trainyard_checkpoint.access import TEAM_HEADER, Target, caller_team, decide
from trainyard_core.errors import InvalidArgument, NotFound, PermissionDenied, TrainyardError
from trainyard_core.security import identity
from trainyard_core.security.authz import JobRef
from trainyard_core.security.job_credentials import JobGrant
from trainyard_core.security.tls import PeerIdentity

BEGIN = "/trainyard.checkpoint.v1.CheckpointService/BeginCheckpoint"
COMMIT = "/trainyard.checkpoint.v1.CheckpointService/CommitCheckpoint"
GET = "/trainyard.checkpoint.v1.CheckpointService/GetCheckpoint"


def job(job_id: str, attempt: int = 1, team: str = "ml") -> PeerIdentity:
    return PeerIdentity(identity.job(job_id), JobGrant(job_id, attempt, team))


SCHEDULER = PeerIdentity(identity.SCHEDULER)
GATEWAY = PeerIdentity(identity.GATEWAY)
TOOL = PeerIdentity(identity.tool("ops"))
NODE = PeerIdentity(identity.node("node-1"))
OWN = Target("job-a", "ml")
OWN_CKPT = Target("job-a", "ml", "ckpt-1", attempt=1)
CASES: list[tuple[str, PeerIdentity, str, JobRef, Target, str, type[TrainyardError] | None, str]] = [
    # (case, caller, method, request names, found, caller's team, refusal, in the message)
    ("own job", job("job-a"), GET, JobRef(checkpoint_id="ckpt-1"), OWN_CKPT, "", None, ""),
    ("another job", job("job-a"), GET, JobRef(checkpoint_id="ckpt-2"), Target("job-b", "ml", "ckpt-2", 1), "",
     PermissionDenied, "trainyard://job/job-a may not call"),
    ("begin as own attempt", job("job-a"), BEGIN, JobRef(job_id="job-a", attempt=1), OWN, "", None, ""),
    ("begin as another attempt", job("job-a"), BEGIN, JobRef(job_id="job-a", attempt=2), OWN, "",
     PermissionDenied, "for attempt 2: its credential is attempt 1's"),
    ("commit own attempt's", job("job-a"), COMMIT, JobRef(checkpoint_id="ckpt-1", same_attempt=True), OWN_CKPT, "",
     None, ""),
    ("commit a newer attempt's", job("job-a"), COMMIT, JobRef(checkpoint_id="ckpt-3", same_attempt=True),
     Target("job-a", "ml", "ckpt-3", attempt=2), "", PermissionDenied, "attempt 2 began it"),
    ("a job's first call (no team yet)", job("job-a"), GET, JobRef(job_id="job-a"), Target("job-a", ""), "", None,
     ""),
    ("a credential of another team", job("job-a", team="vision"), GET, JobRef(job_id="job-a"), OWN, "",
     PermissionDenied, "recorded for team ml"),
    ("scheduler, any job", SCHEDULER, GET, JobRef(job_id="job-z"), Target("job-z", ""), "", None, ""),
    ("gateway, its team", GATEWAY, GET, JobRef(job_id="job-a"), OWN, "ml", None, ""),
    ("gateway, another team's job", GATEWAY, GET, JobRef(checkpoint_id="ckpt-1"), OWN_CKPT, "vision", NotFound,
     "checkpoint ckpt-1 not found"),
    ("tool, a job with no team", TOOL, GET, JobRef(job_id="job-a"), Target("job-a", ""), "ml", NotFound,
     "no checkpoints visible to team ml"),
    ("a node", NODE, GET, JobRef(job_id="job-a"), OWN, "ml", PermissionDenied, "no binding admits a node"),
]


@pytest.mark.parametrize(("case", "caller", "method", "ref", "target", "team", "refusal", "says"), CASES,
                         ids=[c[0] for c in CASES])
def test_decide(case: str, caller: PeerIdentity, method: str, ref: JobRef, target: Target, team: str,
                refusal: type[TrainyardError] | None, says: str) -> None:
    if refusal is None:
        decide(caller, method, ref, target, team)
        return
    with pytest.raises(refusal) as err:
        decide(caller, method, ref, target, team)
    assert says in err.value.message


def test_the_team_header_is_required_well_formed_and_bound_for_tools() -> None:
    bound = {"ops": frozenset({"ml"})}
    assert caller_team(GATEWAY, GET, {TEAM_HEADER: "anything"}, bound) == "anything"
    assert caller_team(TOOL, GET, {TEAM_HEADER: "ml"}, bound) == "ml"
    with pytest.raises(InvalidArgument, match=f"in the {TEAM_HEADER} metadata"):
        caller_team(GATEWAY, GET, {}, bound)
    with pytest.raises(InvalidArgument, match="is not a team"):
        caller_team(GATEWAY, GET, {TEAM_HEADER: "ML team"}, bound)
    with pytest.raises(PermissionDenied, match="may not act for team 'vision'; its teams: ml"):
        caller_team(TOOL, GET, {TEAM_HEADER: "vision"}, bound)
    with pytest.raises(PermissionDenied, match="its teams: none"):
        caller_team(PeerIdentity(identity.tool("ci")), GET, {TEAM_HEADER: "ml"}, bound)
