"""A job's captured output as the gateway handles it: `LogLine` (one line, as the agents answer it) and the
JSON of the events of `GET /v1/jobs/{id}/logs?follow=true` (documented in OpenAPI; the plain answer without
`follow` is text/plain)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pydantic import Field

from .common import ApiModel


@dataclass(frozen=True, slots=True)
class LogLine:
    rank: int
    attempt: int
    stream: str
    text: str
    seq: int = 0      # its number in its (attempt, rank), from 1; 0: a note of the agent, or an old agent's line
    time_ms: int = 0  # when it was written (unix ms); 0: unknown (the agent's file predates per-line times)


class LineEvent(ApiModel):
    """`event: line`: one line of one rank's output."""

    rank: int
    attempt: int
    node: str = Field(description="the node the rank ran on in that attempt")
    stream: str = Field(description="stdout, stderr, or agent (a note of the node agent or the worker's shim)")
    time: datetime | None = Field(None, description="when the worker wrote it (milliseconds, UTC); null for "
                                                    "lines of files written before the node agents recorded a "
                                                    "time per line")
    text: str = Field(description="the line, without its newline")


class WarningEvent(ApiModel):
    """`event: warning`: a node whose lines cannot be read (now); the stream goes on and tries it again."""

    node: str
    attempt: int
    ranks: list[int] = Field(description="the ranks of that attempt on that node, where known")
    message: str = Field(description="why; names the agent's address only for callers who may see addresses "
                                     "(operators)")


class EndEvent(ApiModel):
    """`event: end`, the last event: the job ended (or the attempt asked for is over) and every stream drained."""

    state: str
    exit_code: int | None
    message: str
