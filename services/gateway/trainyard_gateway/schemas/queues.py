"""Queues: the operator's body for PUT /v1/queues/{name}, and a queue as the API shows it.

A queue's `tier` orders jobs before anything else (higher first), `node_labels` confine its jobs to the
nodes that carry all of them (a partition), and `max_gpus` caps what its jobs hold at once.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from trainyard_core import contract as c

from .common import ApiModel, integer, keys_matching, matching

LabelKey = Annotated[str, matching(c.LABEL_KEY)]


class QueuePut(ApiModel):
    """Body of PUT /v1/queues/{name}: the whole queue (a PUT replaces every field)."""

    tier: int = integer(0, ge=c.MIN_QUEUE_TIER, le=c.MAX_QUEUE_TIER, description=(
        "orders queues: every pending job of a higher tier is considered before any of a lower one, and may "
        "preempt it"))
    max_gpus: int = integer(0, ge=0, le=c.MAX_GPUS, description=(
        "most GPUs the queue's jobs hold at once; 0: no cap"))
    node_labels: dict[LabelKey, Annotated[str, Field(max_length=c.MAX_NODE_LABEL_VALUE_LENGTH)]] = Field(
        default_factory=dict, max_length=c.MAX_NODE_LABELS, json_schema_extra=keys_matching(c.LABEL_KEY),
        description="the queue's jobs run only on nodes carrying all of these labels (a partition); empty: any node",
        examples=[{"pool": "reserved"}])
    description: str = Field("", max_length=c.MAX_QUEUE_DESCRIPTION)


class Queue(ApiModel):
    name: str
    tier: int
    max_gpus: int = Field(description="0: no cap")
    node_labels: dict[str, str]
    description: str


class QueueList(ApiModel):
    queues: list[Queue] = Field(description='every queue by name; "default" is always there')
