"""GET /v1/pending: the queue as the leader's last scheduling cycle ordered it (the scheduler's ListPending)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from .common import ApiModel


class PendingJob(ApiModel):
    job_id: str
    team: str
    user: str
    queue: str
    position: int = Field(description="1-based place in its queue as the last cycle ordered it; 0 for a held job "
                                      "(held jobs are not considered, so they have no place)")
    queue_length: int = Field(description="jobs with a place in this queue")
    reason: str = Field(description="why it waits: no fit, quota, a reservation, preempting, held ...")
    held: bool
    queued_at: datetime | None = None


class PendingList(ApiModel):
    jobs: list[PendingJob] = Field(description="in queue order; held jobs last, oldest first")
    total: int = Field(description="how many jobs matched (jobs holds the first `limit`)")
    as_of: datetime | None = Field(default=None, description="when the cycle that ordered them ran (null: the "
                                                             "leader has not run one yet)")
