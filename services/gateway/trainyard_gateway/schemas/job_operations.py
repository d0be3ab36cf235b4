"""Bodies of the job operations: hold, requeue, priority change (PATCH) and resubmit.

A resubmit's `overrides` is a JSON merge patch (RFC 7396) of the submit body: `JobSpecPatch` is `JobSubmit`
with every field optional, made from it (so its bounds and name rules are the submit's own, and the two
cannot drift); nested objects merge, and `null` removes a key (an env variable, a label) or puts a field
back to its default.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, get_args, get_origin

from pydantic import Field, create_model
from pydantic.fields import FieldInfo

from trainyard_core import contract as c

from .common import ApiModel, integer
from .jobs import CancelRequest, CheckpointRequest, JobSubmit, PreemptionRequest, ResourcesRequest, TopologyRequest


class HoldRequest(CancelRequest):
    """Optional body of POST /v1/jobs/{id}:hold."""


class RequeueRequest(CancelRequest):
    """Optional body of POST /v1/jobs/{id}:requeue."""


class JobUpdate(ApiModel):
    """Body of PATCH /v1/jobs/{id}."""

    priority: int = integer(ge=c.MIN_PRIORITY, le=c.MAX_PRIORITY, description=(
        "the job's new priority (order within its queue tier and priority class, higher first); used from the "
        "scheduler's next cycle, for placement and preemption"))


def _optional(info: FieldInfo, annotation: Any) -> tuple[Any, FieldInfo]:
    """The field as a patch has it: the same constraints, not required, default None (absent: unchanged)."""
    patched = copy.copy(info)
    patched.default = None
    patched.default_factory = None
    return annotation | None, patched


_NESTED: dict[type[ApiModel], type[ApiModel]] = {}


def _partial(model: type[ApiModel], name: str) -> type[ApiModel]:
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and annotation in _NESTED:
            annotation = _NESTED[annotation]
        elif get_origin(annotation) is dict:
            # A dictionary merges key by key; null removes the key.
            key, value = get_args(annotation)
            annotation = dict[key, value | None]  # type: ignore[valid-type]
        fields[field_name] = _optional(info, annotation)
    return create_model(name, __base__=ApiModel, __doc__=f"{model.__name__}, every field optional (a merge patch).",
                        **fields)


for _model in (ResourcesRequest, TopologyRequest, PreemptionRequest, CheckpointRequest):
    _NESTED[_model] = _partial(_model, f"{_model.__name__}Patch")
if TYPE_CHECKING:  # made at run time; to the type checker, a model like any other
    JobSpecPatch = ApiModel
else:
    JobSpecPatch = _partial(JobSubmit, "JobSpecPatch")


class ResubmitRequest(ApiModel):
    """Body of POST /v1/jobs/{id}:resubmit."""

    overrides: JobSpecPatch = Field(
        default_factory=lambda: JobSpecPatch(),
        description="changes to the original job's spec, as a JSON merge patch (RFC 7396): the fields given replace "
                    "the original's, objects (resources, env, labels, topology, ...) merge key by key, and null "
                    "removes a key; the result must be a valid submit body",
        examples=[{"resources": {"nodes": 4}, "env": {"LR": "1e-4", "DEBUG": None}, "priority": 10}])
