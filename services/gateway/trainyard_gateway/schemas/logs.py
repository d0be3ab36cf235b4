"""One captured line of a worker's output, as the gateway merges them (not a JSON model of the API:
GET /v1/jobs/{id}/logs answers text/plain)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LogLine:
    rank: int
    attempt: int
    stream: str
    text: str
