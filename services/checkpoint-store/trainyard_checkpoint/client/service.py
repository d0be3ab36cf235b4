"""A blocking client of the CheckpointService for training processes (which are not asyncio programs).

Only the coordinator rank talks to the service: one Begin and one Commit per checkpoint, whatever the
world size. Calls that are safe to repeat (Commit, Abort and the reads are idempotent on the service)
are retried while the service is unavailable; Begin is retried only when the service was unreachable,
where at worst it leaves an unused WRITING reservation that GC aborts.

The credential may be renewed under a running client (credentials.py): each call first asks its
`CredentialSource` whether the files changed (once a second at most, and at once after UNAVAILABLE), and a
new credential gets a new channel. The channel it replaces is closed at the next renewal (or by `close()`),
not at once, so a call still running on it (another thread's) ends normally.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_core import telemetry
from trainyard_core.rpc.server import CHANNEL_OPTIONS
from trainyard_core.security import identity
from trainyard_core.security.tls import target_name_option

from .credentials import CredentialSource, WorkerTls
from .env import ClientSettings, Retention
from .errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
_RETRY_IDEMPOTENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_STATES = {
    pb.CHECKPOINT_STATE_WRITING: "WRITING",
    pb.CHECKPOINT_STATE_COMMITTED: "COMMITTED",
    pb.CHECKPOINT_STATE_ABORTED: "ABORTED",
    pb.CHECKPOINT_STATE_DELETED: "DELETED",
    pb.CHECKPOINT_STATE_DAMAGED: "DAMAGED",
}


@dataclass(frozen=True, slots=True, order=True)
class ShardRecord:
    """One file of a checkpoint: its path relative to the location, size, xxh3c checksum, writer rank."""

    path: str
    size_bytes: int
    checksum: str
    rank: int


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    id: str
    job_id: str
    attempt: int
    step: int
    world_size: int
    location: str
    state: str
    shards: tuple[ShardRecord, ...]
    total_bytes: int
    manifest_path: str

    @property
    def committed(self) -> bool:
        return self.state == "COMMITTED"


def _info(msg: pb.Checkpoint) -> CheckpointInfo:
    return CheckpointInfo(
        id=msg.id, job_id=msg.job_id, attempt=msg.attempt, step=msg.step, world_size=msg.world_size,
        location=msg.location, state=_STATES.get(msg.state, "UNSPECIFIED"),
        shards=tuple(ShardRecord(s.path, s.size_bytes, s.checksum, s.rank) for s in msg.shards),
        total_bytes=msg.total_bytes, manifest_path=msg.manifest_path)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                          "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):  # type: ignore[misc]
    pass


class _TraceParent(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Every call carries the job's trace context (W3C `traceparent` metadata), so the checkpoint-store's spans
    of this worker's calls join the trace of the job's submit."""

    def __init__(self, traceparent: str) -> None:
        self._metadata = (("traceparent", traceparent),)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request: Any) -> Any:
        return continuation(self._details(client_call_details), request)


def open_channel(address: str, tls: WorkerTls | None, insecure_plaintext: bool,
                 traceparent: str = "") -> grpc.Channel:
    """mTLS with the job's credential, accepting only a server whose certificate names
    `trainyard://checkpoint-store` (whatever address it was reached at); plaintext only when asked for.
    `traceparent`: the job's trace, sent with every call (ignored, with a warning, when it is not a W3C
    traceparent)."""
    if tls is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                             certificate_chain=tls.cert_chain)
        channel = grpc.secure_channel(address, creds,
                                      options=[*CHANNEL_OPTIONS, target_name_option(identity.CHECKPOINT_STORE)])
    elif not insecure_plaintext:
        raise ConfigError("the checkpoint client needs a credential or insecure_plaintext")
    else:
        log.warning("checkpoint-store at %s reached over plaintext, without a credential (insecure_plaintext)",
                    address)
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if not traceparent:
        return channel
    if not telemetry.trace_id_of(traceparent):
        log.warning("TRAINYARD_TRACEPARENT is not a W3C traceparent; checkpoint calls go without the job's trace",
                    extra={"traceparent": traceparent[:80]})
        return channel
    return grpc.intercept_channel(channel, _TraceParent(traceparent))


class ServiceClient:
    """Thread-safe (a gRPC channel is). `close()` releases the channels. `tls`: the job's credential; without
    one, `insecure_plaintext=True` must say so."""

    def __init__(self, address: str, *, tls: WorkerTls | None = None, insecure_plaintext: bool = False,
                 timeout_s: float = 60.0, retry_for_s: float = 30.0,
                 check_every_s: float = CredentialSource.CHECK_EVERY_S, traceparent: str = "") -> None:
        self.address = address
        self._traceparent = traceparent
        self._timeout_s = timeout_s
        self._retry_for_s = retry_for_s
        self._source = CredentialSource(tls, check_every_s=check_every_s) if tls is not None else None
        self._lock = threading.Lock()
        self._channel = open_channel(address, tls, insecure_plaintext, traceparent)
        self._retired: grpc.Channel | None = None
        self._current_stub = pb_grpc.CheckpointServiceStub(self._channel)
        self.channels_built = 1  # one more for each renewed credential taken

    @classmethod
    def for_settings(cls, settings: ClientSettings) -> ServiceClient:
        return cls(settings.store_address, tls=settings.tls, insecure_plaintext=settings.insecure_plaintext,
                   timeout_s=settings.rpc_timeout_s, traceparent=settings.traceparent)

    def close(self) -> None:
        with self._lock:
            for channel in (self._channel, self._retired):
                if channel is not None:
                    channel.close()
            self._retired = None

    @property
    def _stub(self) -> pb_grpc.CheckpointServiceStub:
        """The stub of the channel built with the credential as its files hold it now."""
        self._follow_credential(now=False)
        return self._current_stub

    def _follow_credential(self, *, now: bool) -> bool:
        source = self._source
        if source is None or not source.refresh(now=now):
            return False
        with self._lock:
            if self._retired is not None:
                self._retired.close()
            self._retired = self._channel
            self._channel = open_channel(self.address, source.current, False, self._traceparent)
            self._current_stub = pb_grpc.CheckpointServiceStub(self._channel)
            self.channels_built += 1
        return True

    def _call(self, what: str, call: Callable[[], T], *, idempotent: bool) -> T:
        retry = _RETRY_IDEMPOTENT_CODES if idempotent else _RETRY_CODES
        deadline = time.monotonic() + self._retry_for_s
        pause = 0.05
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE and self._follow_credential(now=True):
                    # Refused at the handshake (an expired certificate looks like this), with a renewed one on
                    # disk: the new channel gets the call at once.
                    log.warning("checkpoint-store call %s failed (%s); retrying with the renewed credential",
                                what, code.name)
                    continue
                if code in retry and time.monotonic() + pause < deadline:
                    log.warning("checkpoint-store call %s failed (%s); retrying", what, code.name)
                    time.sleep(pause)
                    pause = min(pause * 2, 2.0)
                    continue
                raise CheckpointError(f"checkpoint-store {what} failed: {code.name}: {e.details()}") from None

    def begin(self, *, job_id: str, attempt: int, step: int, world_size: int, metadata: Mapping[str, str],
              code_version: str = "", retention: Retention | None = None) -> CheckpointInfo:
        req = pb.BeginCheckpointRequest(job_id=job_id, attempt=attempt, step=step, world_size=world_size,
                                        metadata=dict(metadata))
        if code_version:
            req.lineage.code_version = code_version
        if retention is not None:
            req.retention.keep_last = retention.keep_last
            req.retention.keep_every_steps = retention.keep_every_steps
        resp = self._call(f"BeginCheckpoint(job {job_id}, step {step})",
                          lambda: self._stub.BeginCheckpoint(req, timeout=self._timeout_s), idempotent=False)
        return _info(resp.checkpoint)

    def commit(self, checkpoint_id: str, shards: Iterable[ShardRecord]) -> CheckpointInfo:
        req = pb.CommitCheckpointRequest(checkpoint_id=checkpoint_id, shards=[
            pb.ShardInfo(path=s.path, size_bytes=s.size_bytes, checksum=s.checksum, rank=s.rank) for s in shards])
        resp = self._call(f"CommitCheckpoint({checkpoint_id})",
                          lambda: self._stub.CommitCheckpoint(req, timeout=self._timeout_s), idempotent=True)
        return _info(resp.checkpoint)

    def abort(self, checkpoint_id: str, reason: str) -> CheckpointInfo:
        req = pb.AbortCheckpointRequest(checkpoint_id=checkpoint_id, reason=reason[:1024])
        resp = self._call(f"AbortCheckpoint({checkpoint_id})",
                          lambda: self._stub.AbortCheckpoint(req, timeout=self._timeout_s), idempotent=True)
        return _info(resp.checkpoint)

    def get(self, checkpoint_id: str) -> CheckpointInfo:
        req = pb.GetCheckpointRequest(checkpoint_id=checkpoint_id)
        resp = self._call(f"GetCheckpoint({checkpoint_id})",
                          lambda: self._stub.GetCheckpoint(req, timeout=self._timeout_s), idempotent=True)
        return _info(resp.checkpoint)

    def latest(self, job_id: str) -> CheckpointInfo | None:
        """The job's latest committed checkpoint, None when it has none."""
        req = pb.GetLatestCheckpointRequest(job_id=job_id)
        try:
            resp = self._stub.GetLatestCheckpoint(req, timeout=self._timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            resp = self._call(f"GetLatestCheckpoint({job_id})",
                              lambda: self._stub.GetLatestCheckpoint(req, timeout=self._timeout_s),
                              idempotent=True)
        return _info(resp.checkpoint)

    def list_all(self, job_id: str) -> list[CheckpointInfo]:
        """Every checkpoint of the job (all states), in creation order."""
        out: list[CheckpointInfo] = []
        token = ""
        while True:
            req = pb.ListCheckpointsRequest(job_id=job_id, page_size=1000, page_token=token)
            resp = self._call(f"ListCheckpoints({job_id})",
                              lambda req=req: self._stub.ListCheckpoints(req, timeout=self._timeout_s),  # type: ignore[misc]
                              idempotent=True)
            out.extend(_info(c) for c in resp.checkpoints)
            token = resp.next_page_token
            if not token:
                return out

    def report_damaged(self, checkpoint_id: str, shard_paths: Iterable[str], reason: str) -> str | None:
        """Tell the service a committed checkpoint is damaged; it checks the named shards itself and, if
        confirmed, marks it DAMAGED and moves the job's latest pointer back. Returns the job's latest
        checkpoint id afterwards (None: none left). CheckpointError when the service does not confirm."""
        req = pb.ReportDamagedRequest(checkpoint_id=checkpoint_id, shard_paths=sorted(set(shard_paths)),
                                      reason=reason[:1024])
        resp = self._call(f"ReportDamaged({checkpoint_id})",
                          lambda: self._stub.ReportDamaged(req, timeout=self._timeout_s), idempotent=True)
        return resp.latest_checkpoint_id or None

    def acquire_restore_lease(self, checkpoint_id: str, ttl_s: int, holder: str) -> str | None:
        """A lease that keeps GC and Delete off the checkpoint while it is loaded. None when the service
        does not offer leases; CheckpointError when the checkpoint cannot be leased (deleted meanwhile)."""
        req = pb.AcquireRestoreLeaseRequest(checkpoint_id=checkpoint_id, ttl_s=ttl_s, holder=holder[:256])
        try:
            resp = self._call(f"AcquireRestoreLease({checkpoint_id})",
                              lambda: self._stub.AcquireRestoreLease(req, timeout=self._timeout_s), idempotent=True)
        except CheckpointError as e:
            if "UNIMPLEMENTED" in e.message:
                return None
            raise
        return str(resp.lease_id)

    def release_restore_lease(self, checkpoint_id: str, lease_id: str) -> None:
        req = pb.ReleaseRestoreLeaseRequest(checkpoint_id=checkpoint_id, lease_id=lease_id)
        try:
            self._call(f"ReleaseRestoreLease({checkpoint_id})",
                       lambda: self._stub.ReleaseRestoreLease(req, timeout=self._timeout_s), idempotent=True)
        except CheckpointError as e:
            # It expires by itself; a failed release only keeps the checkpoint a little longer.
            log.warning("could not release the restore lease on %s: %s", checkpoint_id, e)
