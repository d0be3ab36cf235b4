"""The audit log as the API shows it (GET /v1/audit)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from .common import ApiModel


class AuditEntry(ApiModel):
    id: str = Field(description="unique; ids sort newest first")
    time: datetime
    principal: str = Field(description="`user:<team>/<user>` (a gateway token), `trainyard://<kind>[/<name>]` "
                                       "(a service's or tool's certificate), or `anonymous`")
    role: str = Field(description="the token's role for gateway users; empty for certificates")
    service: str = Field(description="the service that recorded the call: gateway, scheduler, "
                                     "checkpoint-store")
    action: str = Field(description="HTTP method and route template (`POST /v1/jobs/{job_id}:cancel`) or gRPC "
                                    "full method (`/trainyard.scheduler.v1.JobService/CancelJob`)")
    target: str = Field(description="what the call acts on, `<kind>/<id>` (job/..., node/..., queue/..., "
                                    "team/..., token/..., checkpoint/...); empty when the call named none")
    team: str = Field(description="the team the call acts for, when known")
    result: str = Field(description="`ok`, or the error code (permission_denied, not_found, unauthenticated, ...)")
    message: str = Field(description="the error message, shortened; empty when ok")
    request_id: str = Field(description="the X-Request-Id of the HTTP request (or the x-request-id gRPC "
                                        "metadata) the call was made under")
    detail: dict[str, str] = Field(description="a few small fields (HTTP status, a cancel's reason, ...); never "
                                               "secrets")


class AuditPage(ApiModel):
    entries: list[AuditEntry] = Field(description="newest first")
    next_page_token: str = Field(description="pass as page_token for older entries; empty when there are "
                                             "none. A page may hold fewer entries than page_size (even none) "
                                             "while more may follow: each request reads a bounded stretch of "
                                             "the log")
