"""The Python SDK of Trainyard's gateway: `Client` (sync) and `AsyncClient` (asyncio), with the same methods.

    from trainyard_sdk import Client, NotFound

    with Client.from_env() as trainyard:          # TRAINYARD_URL / TRAINYARD_TOKEN, as the CLI finds them
        job = trainyard.submit_job({"name": "smoke", "command": ["python", "train.py"],
                                    "resources": {"nodes": 1, "gpus_per_node": 8}})
        for failed in trainyard.list_jobs(state="failed", user="alice"):   # every page
            print(failed.id, failed.message)
        for event in trainyard.follow_logs(job.id):                         # server-sent events, resumed
            ...

Results are the gateway's own models (`trainyard_gateway.schemas`: `Job`, `Node`, `Quota`, ...); failures are
`SdkError`s carrying the API's error code (errors.py). The layers: `operations`/`streams` build each call
(pure), `methods` gives both clients the same table of them, `client`/`aio` do the I/O, `wire` holds the pure
decisions (parsing, retries, resuming), `sse` parses server-sent events.
"""

from trainyard_gateway.schemas.audit import AuditEntry, AuditPage
from trainyard_gateway.schemas.checkpoints import CheckpointList, CheckpointManifest, JobCheckpoint
from trainyard_gateway.schemas.health import Health
from trainyard_gateway.schemas.jobs import Job, JobList, JobSubmit
from trainyard_gateway.schemas.logs import EndEvent, LineEvent, WarningEvent
from trainyard_gateway.schemas.nodes import Node
from trainyard_gateway.schemas.pending import PendingJob, PendingList
from trainyard_gateway.schemas.queues import Queue, QueuePut
from trainyard_gateway.schemas.quotas import Quota, QuotaPut
from trainyard_gateway.schemas.streams import JobEnd
from trainyard_gateway.schemas.tokens import Token, TokenCreated
from trainyard_gateway.schemas.usage import UsageReport

from .aio import AsyncClient
from .client import Client
from .config import Target
from .connection import VERSION as __version__
from .errors import (
    AlreadyExists,
    ApiError,
    ConfigurationError,
    Conflict,
    ConnectionFailed,
    FailedPrecondition,
    IdempotencyKeyReused,
    InsufficientStorage,
    InvalidArgument,
    InvalidPageToken,
    NotFound,
    PermissionDenied,
    ProtocolError,
    RateLimited,
    SdkError,
    Unauthenticated,
    Unavailable,
)
from .streaming import AsyncEventStream, EventStream
from .wire import Reconnect, Retry

__all__ = [
    "AlreadyExists", "ApiError", "AsyncClient", "AsyncEventStream", "AuditEntry", "AuditPage", "CheckpointList",
    "CheckpointManifest", "Client", "ConfigurationError", "Conflict", "ConnectionFailed", "EndEvent", "EventStream",
    "FailedPrecondition", "Health", "IdempotencyKeyReused", "InsufficientStorage", "InvalidArgument",
    "InvalidPageToken", "Job", "JobCheckpoint", "JobEnd", "JobList", "JobSubmit", "LineEvent", "Node", "NotFound",
    "PendingJob", "PendingList", "PermissionDenied", "ProtocolError", "Queue", "QueuePut", "Quota", "QuotaPut",
    "RateLimited", "Reconnect", "Retry", "SdkError", "Target", "Token", "TokenCreated", "Unauthenticated",
    "Unavailable", "UsageReport", "WarningEvent", "__version__",
]
