"""Resubmit (Determined's fork): a new job from an earlier job's spec with changes, submitted as the caller.

Built in the gateway on the scheduler's GetJob and SubmitJob, not as an RPC of its own: GetJob already reads a
finished job from the history store once it has left etcd, SubmitJob validates and accounts the new job as
any submit (team, user, idempotency key), and the merge is about the HTTP body (a JSON merge patch of it),
which the scheduler does not know. Pure: the router does the two calls.

The new job's `resubmitted_from` label names the job it came from (a resubmit of a resubmit names the latest).
The history store keeps an environment's names, not its values (they may be secrets): a job read from there
gives its variables back empty, and the caller passes them again in `overrides.env`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from trainyard_core import contract
from trainyard_core.errors import FailedPrecondition

from .http_errors import describe_validation_errors
from .schemas.jobs import Job, JobSubmit


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: objects merge key by key, null removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def resubmitted_spec(source: Job, overrides: dict[str, Any]) -> JobSubmit:
    """The submit body of the resubmit: `source`'s spec with `overrides` merged in and the origin label set.
    FailedPrecondition naming the field when the result is not a valid submit: the overrides are well formed
    (their schema is checked before), but do not make a job together with this job's spec (a `wait_s` for a
    spec without a topology tier, `accelerators` beside its `accelerator`), so the API answers 409, not 400,
    which it keeps for requests that break their schema."""
    merged = merge_patch(source.spec.model_dump(mode="json"), overrides)
    merged["labels"] = {**(merged.get("labels") or {}), contract.RESUBMITTED_FROM_LABEL: source.id}
    try:
        return JobSubmit.model_validate(merged)
    except ValidationError as exc:
        problems = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise FailedPrecondition(f"the spec of {source.id} with these overrides is not a valid job spec: "
                              f"{describe_validation_errors(problems)}") from None
