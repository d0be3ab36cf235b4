"""The audit log: one entry per mutating call on every service, written before the caller hears the result.

An entry says who (`principal`: a certificate's `trainyard://<kind>[/<name>]`, or a gateway user
`user:<team>/<user>` with its `role`), did what (`action`: the gRPC full method, or the HTTP method and
route template), to what (`target`, `<kind>/<id>`: `job/j-...`, `node/gpu-01`, `queue/batch`,
`team/vision`, `token/t-...`, `checkpoint/ck-...`), with which outcome (`result`: `ok`, or the error code
such as `permission_denied` with a short `message`), when, and under which request id (the gateway's, or
the `x-request-id` gRPC metadata; a fresh one otherwise). `detail` holds a few small fields, never secrets:
no environment values, no token secrets, no job spec.

Sinks:
- `AuditLog` (scheduler, checkpoint-store, gateway): etcd, under `<prefix>/audit/<id>`. An id is 12
  base32 characters of (2^60 - 1 - the entry's time in microseconds) and 8 random ones: ids of entries
  from any number of processes never collide, and their byte order is time order, newest first, which is
  the order a query reads them in (the store's range is ascending only). A page token is the last id a
  page read, so a page's successor is the same whatever was appended meanwhile (new entries sort before
  it). Retention: each entry is put under one etcd lease per time bucket (an hour) with a TTL of
  `retention_s` + one bucket, granted by the first append of the bucket, so an entry lives at least
  `retention_s` and etcd drops a whole hour at once. With a history store, the scheduler's leader moves the
  entries out of etcd within seconds (trainyard_scheduler.audit_archive), and reads merge both parts; the
  lease is then what bounds the entries an outage of the history store leaves in etcd.
- `AuditFile` (node agent, which has no etcd access): JSON lines under its state directory, fsynced per
  entry, rotated by size.

Writing: `record(sink, entry)` is awaited by the interceptor (gRPC) or middleware (HTTP) before the answer
leaves, and survives the call being cancelled. Concurrent appends to etcd share transactions
(`store/batch.py`): each entry is still its own compare and put, and is acknowledged only once stored. A
sink retries a failed write a few times; if it still fails, the caller gets the true result of its call
anyway (the action happened, or did not, whatever the audit write did), the failure is logged at ERROR and
`trainyard_audit_write_failures_total` is counted. An action stored by one etcd transaction on the log's own
store may carry its entry in that transaction instead (`InlineAudit`; the scheduler's job create does): one
round trip for both, and the one cannot be stored without the other.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import re
import secrets
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import Counter

from . import contract
from .clock import Clock, SystemClock
from .errors import FailedPrecondition, InvalidArgument, Unavailable
from .store.api import Compare, Put, Store, absent
from .store.batch import TxnBatcher

log = logging.getLogger(__name__)

RESULT_OK = "ok"
ANONYMOUS = "anonymous"  # a call without a usable identity (no token, plaintext gRPC)
MAX_MESSAGE = 200
MAX_DETAIL_FIELDS = 8
MAX_DETAIL_VALUE = 200
MAX_FIELD = 256  # principal, action, target, team, role
DEFAULT_RETENTION_DAYS = 30
BUCKET_S = 3600
# A query reads at most this many entries per page (matching or not), then answers with what it found and a
# page token: a filter that matches little costs a bounded read, never a scan of the whole log.
MAX_SCAN = 5000
_CHUNK = 500
WRITE_ATTEMPTS = 3
WRITE_BACKOFF_S = 0.05
# The most an append may add to a call's answer, retries included: an etcd that does not answer (each call of
# the store is bounded by its own timeout, 5 s) must not hold every mutating call for the attempts' sum.
WRITE_DEADLINE_S = 3.0
REQUEST_ID = contract.Name(r"^[A-Za-z0-9._:-]{1,64}$", "1-64 letters, digits, '.', '_', ':' or '-'")
REQUEST_ID_HEADER = "x-request-id"  # HTTP header and gRPC metadata key alike

WRITE_FAILURES = Counter("trainyard_audit_write_failures_total",
                         "Audit entries that could not be written after retries (the call itself was answered "
                         "with its true result)", ["sink"])

# The request id of the call being served, for the calls it makes in turn (the gateway's to the scheduler).
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
# Who a service authenticated on top of its caller's certificate for the call being served (the user of the
# bearer token a TokenService call carries, as `<team>/<user>`), recorded in the entry's detail as `acting_user`
# with its role; '' when the certificate is the whole story.
acting_user: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("acting_user", default=("", ""))

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case: byte order is numeric order
_TIME_DIGITS = 12  # 60 bits of microseconds: good until the year 38000
_MAX_US = (1 << (5 * _TIME_DIGITS)) - 1
_ID_LENGTH = _TIME_DIGITS + 8


def _b32(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        out.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def _us(t: float) -> int:
    return max(0, int(t * 1_000_000))


def _time_part(us: int) -> str:
    return _b32(_MAX_US - min(us, _MAX_US), _TIME_DIGITS)


def new_entry_id(t: float) -> str:
    """A unique id whose byte order is `t`'s order, newest first."""
    return _time_part(_us(t)) + _b32(secrets.randbits(40), 8)


def entry_id_time(entry_id: str) -> float:
    value = 0
    for ch in entry_id[:_TIME_DIGITS]:
        value = value * 32 + _ALPHABET.index(ch)
    return (_MAX_US - value) / 1_000_000


def _is_entry_id(value: str) -> bool:
    return len(value) == _ID_LENGTH and all(ch in _ALPHABET for ch in value)


def ids_between(since: float | None, until: float | None) -> tuple[str | None, str | None]:
    """(after, through): the ids of entries stamped in [since, until], to the microsecond, are those above
    `after` and at most `through` (None: no bound on that side). Newest first, so `until` gives the lower id."""
    after = _time_part(_us(until) + 1) + _ALPHABET[-1] * 8 if until is not None else None
    through = _time_part(_us(since)) + _ALPHABET[-1] * 8 if since is not None else None
    return after, through


def action_name(action: str) -> str:
    """The last part of an action, after its last '/' or ' ' (`CancelJob` of the gRPC method, `cancel` of
    `POST /v1/jobs/{job_id}/cancel`): what a filter's short form names."""
    return action[max(action.rfind("/"), action.rfind(" ")) + 1:]


def new_request_id() -> str:
    return "r-" + secrets.token_hex(8)


def request_id_or_new(value: str | None) -> str:
    """The caller's request id when it is one (REQUEST_ID), else a fresh one: an id is echoed into logs and
    answers, so whatever a client sends is not taken as it is."""
    return value if value and REQUEST_ID.matches(value) else new_request_id()


# The gateway's validation messages quote the offending value, ` (got '...')`: that value may be a job's env
# value or part of a token, so an entry keeps the message without it.
_QUOTED_VALUE = re.compile(r""" \(got (?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^()]*)\)""")


def without_values(message: str) -> str:
    return _QUOTED_VALUE.sub("", message)


def _clip(text: str, limit: int) -> str:
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    time: float
    principal: str
    service: str
    action: str
    target: str = ""
    result: str = RESULT_OK
    message: str = ""
    request_id: str = ""
    role: str = ""
    team: str = ""
    detail: Mapping[str, str] = field(default_factory=dict)
    id: str = ""  # given by the sink that stores it

    @classmethod
    def make(cls, *, time: float, principal: str, service: str, action: str, target: str = "",
             result: str = RESULT_OK, message: str = "", request_id: str = "", role: str = "", team: str = "",
             detail: Mapping[str, object] | None = None) -> AuditEntry:
        """An entry with every field bounded: a message of MAX_MESSAGE characters without the values it quotes,
        at most MAX_DETAIL_FIELDS detail fields of MAX_DETAIL_VALUE, one line each."""
        small = {_clip(str(k), 64): _clip(str(v), MAX_DETAIL_VALUE)
                 for k, v in list((detail or {}).items())[:MAX_DETAIL_FIELDS]}
        return cls(time=time, principal=_clip(principal, MAX_FIELD), service=_clip(service, 64),
                   action=_clip(action, MAX_FIELD), target=_clip(target, MAX_FIELD), result=_clip(result, 64),
                   message=_clip(without_values(message), MAX_MESSAGE), request_id=request_id_or_new(request_id),
                   role=_clip(role, 64), team=_clip(team, MAX_FIELD), detail=small)

    @property
    def user(self) -> str:
        """The user name of a gateway user's entry ('' for certificate principals)."""
        return self.principal.partition("/")[2] if self.principal.startswith("user:") else ""

    def to_json(self) -> bytes:
        return json.dumps(entry_to_dict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> AuditEntry:
        data = json.loads(raw)
        return cls(time=float(data["time"]), principal=str(data["principal"]), service=str(data["service"]),
                   action=str(data["action"]), target=str(data.get("target", "")),
                   result=str(data.get("result", RESULT_OK)), message=str(data.get("message", "")),
                   request_id=str(data.get("request_id", "")), role=str(data.get("role", "")),
                   team=str(data.get("team", "")),
                   detail={str(k): str(v) for k, v in dict(data.get("detail") or {}).items()},
                   id=str(data.get("id", "")))


def user_principal(team: str, user: str) -> str:
    return f"user:{team}/{user}"


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """What a query keeps; every field given must match. `action` matches the whole action or its last part
    (`CancelJob` matches `/trainyard.scheduler.v1.JobService/CancelJob`); `user` matches the user of a
    gateway user's principal, in any team (with `team`, in that one). `request_id` finds every service's
    entries of one request."""

    principal: str = ""
    user: str = ""
    team: str = ""
    action: str = ""
    target: str = ""
    result: str = ""
    request_id: str = ""
    since: float | None = None
    until: float | None = None

    def matches(self, e: AuditEntry) -> bool:
        if self.principal and e.principal != self.principal:
            return False
        if self.user and e.user != self.user:
            return False
        if self.team and e.team != self.team:
            return False
        if self.action and e.action != self.action and not e.action.endswith(("/" + self.action,
                                                                             " " + self.action)):
            return False
        if self.target and e.target != self.target:
            return False
        if self.result and e.result != self.result:
            return False
        if self.request_id and e.request_id != self.request_id:
            return False
        if self.since is not None and e.time < self.since:
            return False
        return self.until is None or e.time <= self.until


@dataclass(frozen=True, slots=True)
class AuditPage:
    entries: list[AuditEntry]
    next_page_token: str  # '' when nothing older matches


# A page token is the id of the last entry a page read. Any id-shaped token is a valid place to go on from
# (the entries after it), so every token the schema admits is answered, never refused for its content.
PAGE_TOKEN = contract.Name(f"^[{_ALPHABET}]{{{_ID_LENGTH}}}$", f"{_ID_LENGTH} characters of [{_ALPHABET}]: the "
                           "next_page_token of the previous page")


def encode_page_token(entry_id: str) -> str:
    return entry_id


def decode_page_token(token: str) -> str:
    """The id a page token continues after; InvalidArgument for anything that is not one."""
    if not _is_entry_id(token):
        raise InvalidArgument("page_token is not one this API handed out: pass next_page_token of the previous "
                              "page unchanged, or none for the first page")
    return token


class AuditSink(Protocol):
    name: str

    async def append(self, entry: AuditEntry) -> bool:
        """Store `entry` durably (retrying a few times); True once it is stored, False when it could not be
        (logged and counted). Never raises for a failed write."""


_pending: set[asyncio.Task[bool]] = set()


async def record(sink: AuditSink | None, entry: AuditEntry) -> bool:
    """Append `entry` and wait for it; a caller cancelled meanwhile leaves the write to finish on its own."""
    if sink is None:
        return False
    task = asyncio.ensure_future(sink.append(entry))
    _pending.add(task)
    task.add_done_callback(_pending.discard)
    return await asyncio.shield(task)


@dataclass(frozen=True)
class Carried:
    """Audit entries as the ops of another transaction: a compare and a put (on its bucket's lease) for each."""

    entries: tuple[AuditEntry, ...]
    compares: tuple[Compare, ...]
    puts: tuple[Put, ...]
    log: AuditLog
    buckets: tuple[int, ...]

    async def lease_gone(self) -> None:
        """The transaction was refused for a lease: if it was one of these, the next write takes a new one."""
        for bucket, put in zip(self.buckets, self.puts, strict=True):
            await self.log.forget_lease(bucket, put.lease)


@dataclass
class InlineAudit:
    """The entries of the audited call being served, offered to the transaction that stores its action.

    A handler whose action is one etcd transaction on the audit log's own store (a submit's job create) asks
    `carry(store, target)` for the entries' compares and puts and adds them to that transaction: the action and
    its record are then stored together, in one round trip instead of two in turn, and neither can exist
    without the other. Once that transaction is stored the handler calls `stored()`, and the interceptor writes
    no second entry. A handler that does not take them, or whose transaction was not stored, leaves the entry
    to the interceptor, which writes it as for any call (with the call's true result).

    `forwarded`: the entry the caller would write of the same action once answered (the gateway's of the HTTP
    request behind the call, FORWARDED_ENTRY_HEADER), carried as well with the target filled in; the caller is
    told that it was (CARRIED_HEADER) and writes nothing itself."""

    log: AuditLog
    make: Callable[[str], AuditEntry]  # the target → the entry of the call succeeding on it
    forwarded: AuditEntry | None = None
    pending: Carried | None = None
    written: tuple[AuditEntry, ...] = ()

    async def carry(self, store: Store, target: str) -> Carried | None:
        """The entries' ops for a transaction on `store` (None when this log is on another store)."""
        if store is not self.log.store:
            return None
        entries = [self.make(target)]
        if self.forwarded is not None:
            entries.append(replace(self.forwarded, target=target))
        self.pending = await self.log.carried(entries)
        return self.pending

    def stored(self) -> None:
        """The transaction that carried the entries is stored."""
        if self.pending is not None:
            self.written, self.pending = self.pending.entries, None

    @property
    def forwarded_written(self) -> bool:
        """The forwarded entry is stored (it is carried with the call's own, whenever there is one)."""
        return self.forwarded is not None and bool(self.written)


# The audited call being served, when its sink can ride on the action's transaction (AuditInterceptor).
inline_audit: contextvars.ContextVar[InlineAudit | None] = contextvars.ContextVar("inline_audit", default=None)
# gRPC metadata: the caller's own entry of the action, for the callee to carry (JSON; only the gateway's is
# taken), and the callee's answer that it stored it.
FORWARDED_ENTRY_HEADER = "x-trainyard-audit-entry"
GATEWAY_SERVICE = "gateway"  # the service name of the gateway's entries
CARRIED_HEADER = "x-trainyard-audit-carried"


def _give_up(sink: str, entry: AuditEntry, why: BaseException | str) -> bool:
    WRITE_FAILURES.labels(sink=sink).inc()
    log.error("audit entry not written", extra={
        "audit_sink": sink, "audit_action": entry.action, "audit_principal": entry.principal,
        "audit_target": entry.target, "audit_result": entry.result, "request_id": entry.request_id,
        "error": str(why)[:300]})
    return False


async def _with_retries(sink: str, entry: AuditEntry, attempt: Callable[[], Awaitable[None]],
                        retryable: tuple[type[BaseException], ...]) -> bool:
    last: BaseException | None = None
    try:
        async with asyncio.timeout(WRITE_DEADLINE_S):
            for n in range(WRITE_ATTEMPTS):
                try:
                    await attempt()
                    return True
                except retryable as exc:
                    last = exc
                    if n + 1 < WRITE_ATTEMPTS:
                        await asyncio.sleep(WRITE_BACKOFF_S * (4 ** n))
    except TimeoutError:
        return _give_up(sink, entry, f"no answer within {WRITE_DEADLINE_S:g}s (the entry may or may not be "
                                     f"stored; last error: {last})")
    assert last is not None
    return _give_up(sink, entry, last)


class AuditLog:
    """The etcd audit log of one deployment (`<prefix>/audit/`): `append` and `query`. Safe for concurrent
    use from one event loop; any number of processes may append to the same prefix."""

    name = "etcd"

    def __init__(self, store: Store, prefix: str, *, retention_s: float = DEFAULT_RETENTION_DAYS * contract.DAY_S,
                 bucket_s: float = BUCKET_S, clock: Clock | None = None) -> None:
        if retention_s <= 0 or bucket_s <= 0:
            raise ValueError("retention_s and bucket_s must be positive")
        self._store = store
        # Entries are independent writes: appended concurrently, they share etcd transactions (store/batch.py).
        self._batch = TxnBatcher(store)
        self.prefix = prefix.rstrip("/") + "/audit/"
        self._retention_s = retention_s
        self._bucket_s = bucket_s
        self._clock = clock or SystemClock()
        self._leases: dict[int, int] = {}  # bucket → lease id
        self._lease_lock = asyncio.Lock()

    @property
    def store(self) -> Store:
        return self._store

    def key(self, entry_id: str) -> str:
        return self.prefix + entry_id

    async def _lease(self, bucket: int) -> int:
        async with self._lease_lock:
            lease = self._leases.get(bucket)
            if lease is None:
                lease = await self._store.grant_lease(int(self._retention_s + self._bucket_s + 0.999))
                self._leases = {b: v for b, v in self._leases.items() if b >= bucket - 1}
                self._leases[bucket] = lease
            return lease

    def _stamped(self, entry: AuditEntry) -> tuple[AuditEntry, int]:
        t = entry.time or self._clock.now()
        return replace(entry, time=t, id=new_entry_id(t)), int(t // self._bucket_s)

    async def forget_lease(self, bucket: int, lease: int) -> None:
        """The bucket's lease is gone (revoked, or etcd lost it): the next write of the bucket takes a new one."""
        async with self._lease_lock:
            if self._leases.get(bucket) == lease:
                del self._leases[bucket]

    async def append(self, entry: AuditEntry) -> bool:
        stored, bucket = self._stamped(entry)
        key, value = self.key(stored.id), stored.to_json()

        async def attempt() -> None:
            lease = await self._lease(bucket)
            try:
                # absent(key): a retry after a write whose answer was lost finds its own entry, never doubles it.
                await self._batch.txn([absent(key)], [Put(key, value, lease)])
            except FailedPrecondition:
                await self.forget_lease(bucket, lease)
                raise

        return await _with_retries(self.name, stored, attempt, (Unavailable, FailedPrecondition))

    async def carried(self, entries: Sequence[AuditEntry]) -> Carried:
        """`entries` as another transaction on this log's store carries them (see InlineAudit)."""
        stamped = [self._stamped(e) for e in entries]
        keys = [self.key(e.id) for e, _ in stamped]
        leases = [await self._lease(bucket) for _, bucket in stamped]
        puts = tuple(Put(k, e.to_json(), lease) for k, (e, _), lease in zip(keys, stamped, leases, strict=True))
        return Carried(tuple(e for e, _ in stamped), tuple(absent(k) for k in keys), puts, self,
                       tuple(bucket for _, bucket in stamped))

    async def query(self, flt: AuditFilter, *, page_size: int = contract.DEFAULT_PAGE_SIZE,
                    page_token: str = "") -> AuditPage:
        """Matching entries, newest first, at most `page_size`; reads at most MAX_SCAN entries per call."""
        if not 1 <= page_size <= contract.MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size must be 1-{contract.MAX_PAGE_SIZE} (got {page_size})")
        start = self.key(decode_page_token(page_token)) if page_token else None
        newest, _ = ids_between(None, flt.until)
        if newest is not None:  # every id of a time after `until` sorts at or before this one
            bound = self.key(newest)
            start = max(start, bound) if start is not None else bound
        out: list[AuditEntry] = []
        scanned = 0
        while True:
            page = await self._store.range(self.prefix, start_after=start, limit=_CHUNK)
            for kv in page.kvs:
                scanned += 1
                entry_id = kv.key[len(self.prefix):]
                start = kv.key
                if flt.since is not None and _is_entry_id(entry_id) and entry_id_time(entry_id) < flt.since:
                    return AuditPage(out, "")
                try:
                    entry = AuditEntry.from_json(kv.value)
                except (ValueError, KeyError, TypeError):
                    log.warning("unreadable audit entry skipped", extra={"key": kv.key})
                    continue
                if flt.matches(entry):
                    out.append(entry)
                    if len(out) == page_size:
                        return AuditPage(out, encode_page_token(entry_id))
                if scanned >= MAX_SCAN:
                    return AuditPage(out, encode_page_token(entry_id))
            if not page.more:
                return AuditPage(out, "")


class AuditFile:
    """JSON lines in `path`, one fsync per entry; at `max_bytes` the file becomes `<path>.1` (older ones
    `.2` ... up to `backups`, the oldest dropped). Appends run on a worker thread, one at a time."""

    name = "file"

    def __init__(self, path: Path, *, max_bytes: int, backups: int, clock: Clock | None = None) -> None:
        self.path = path
        self._max_bytes = max_bytes
        self._backups = backups
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()

    def _rotate(self) -> None:
        if self._backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for n in range(self._backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def _write(self, line: bytes) -> None:
        with self._lock:
            try:
                if self.path.stat().st_size + len(line) > self._max_bytes:
                    self._rotate()
            except FileNotFoundError:
                pass
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    async def append(self, entry: AuditEntry) -> bool:
        t = entry.time or self._clock.now()
        stored = replace(entry, time=t, id=new_entry_id(t))
        line = stored.to_json() + b"\n"

        async def attempt() -> None:
            await asyncio.to_thread(self._write, line)

        return await _with_retries(self.name, stored, attempt, (OSError,))

    def entries(self) -> list[AuditEntry]:
        """Every entry of the current file and its rotated ones, oldest first (for tools and tests)."""
        out: list[AuditEntry] = []
        for n in range(self._backups, -1, -1):
            path = self.path if n == 0 else self.path.with_name(f"{self.path.name}.{n}")
            if path.exists():
                out += [AuditEntry.from_json(line) for line in path.read_text().splitlines() if line.strip()]
        return out


def entry_to_dict(entry: AuditEntry) -> dict[str, Any]:
    """Every field by name (dataclasses.asdict deep-copies each value: a few percent of a submit's CPU, whose
    audit entries are encoded on the scheduler's event loop)."""
    return {"time": entry.time, "principal": entry.principal, "service": entry.service, "action": entry.action,
            "target": entry.target, "result": entry.result, "message": entry.message,
            "request_id": entry.request_id, "role": entry.role, "team": entry.team, "detail": dict(entry.detail),
            "id": entry.id}
