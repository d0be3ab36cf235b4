"""Queues: the operator's body for PUT /v1/queues/{name}, and a queue as the API shows it.

A queue's `tier` orders jobs before anything else (higher first), `node_labels` confine its jobs to the
nodes that carry all of them (a partition), and `max_gpus` caps what its jobs hold at once.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator

from .common import ApiModel

QUEUE_NAME_RULE = ("1-63 lower-case letters, digits, '-' or '_', starting and ending with a letter or digit")
QUEUE_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$")
MAX_GPUS = 10_000_000


class QueuePut(ApiModel):
    """Body of PUT /v1/queues/{name}: the whole queue (a PUT replaces every field)."""

    tier: Annotated[int, Field(strict=True, ge=-1000, le=1000, description=(
        "orders queues: every pending job of a higher tier is considered before any of a lower one, and may "
        "preempt it"))] = 0
    max_gpus: Annotated[int, Field(strict=True, ge=0, le=MAX_GPUS, description=(
        "most GPUs the queue's jobs hold at once; 0: no cap"))] = 0
    node_labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=16,
        description="the queue's jobs run only on nodes carrying all of these labels (a partition); empty: any node",
        examples=[{"pool": "reserved"}])
    description: str = Field("", max_length=512)

    @field_validator("node_labels")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not 1 <= len(key) <= 63:
                raise ValueError(f"label keys must be 1-63 characters, got {key[:80]!r}")
        return value


class Queue(ApiModel):
    name: str
    tier: int
    max_gpus: int = Field(description="0: no cap")
    node_labels: dict[str, str]
    description: str


class QueueList(ApiModel):
    queues: list[Queue] = Field(description='every queue by name; "default" is always there')
