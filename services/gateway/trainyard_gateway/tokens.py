"""API tokens: random secrets handed out once, stored only as their SHA-256 hash.

Keys (all under the gateway's etcd prefix):
- `{prefix}/gateway/tokens/<sha256 hex of the secret>` → JSON record: token_id, team, user, role,
  created_at, expires_at, scopes, description. Authentication is one lookup by hash; the secret itself is never stored,
  logged or echoed back after creation.
- `{prefix}/gateway/token-ids/<token_id>` → the hash, so a token can be revoked by its public id.
Both keys are written and deleted together in one transaction.

A plain SHA-256 (no salt, no slow KDF) is enough because secrets are 256 random bits, not passwords:
there is nothing to brute-force. Verified tokens are cached in memory for `cache_ttl_s`; a revocation
through this process drops its cache entry at once, one through another gateway takes effect here
within the TTL. Only hits are cached: unknown secrets always go to etcd. Expiry is checked on every
request, cached or not, against the injected clock's wall time.

A token in use is read again before its entry runs out (refresh-ahead): a request that finds its entry past
half the TTL is answered from it at once, and the record is read from etcd in the background (one read per
token at a time); the entry then holds the new read, or is dropped if the token is gone. A read that fails
is not tried again for that entry (in an etcd outage every request would start, and log, another). Without it every
client in use paid a synchronous etcd read every TTL, behind whatever else etcd was doing: in a burst of
1,000 submits from 100 clients, 84 requests carried such a read (42-44 ms each under the burst's writes) and
they were the slowest ones. The bound on a revocation made elsewhere is the same (an entry never serves
longer than the TTL after the read that filled it began).

Records written before roles existed carry `admin: bool` and no role, expiry or scopes. They still load:
admin → operator, otherwise member, never expiring, marked `legacy` so listings show them for rotation.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from trainyard_core import contract
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.contract import Role, Scope
from trainyard_core.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from trainyard_core.ids import new_id
from trainyard_core.store import Delete, Put, Store, absent

log = logging.getLogger(__name__)
SECRET_PREFIX = "ty_"
_SECRET_RE = re.compile(r"^ty_[A-Za-z0-9_-]{20,200}$")
_CACHE_MAX = 10_000


def new_secret() -> str:
    """A fresh token secret: `ty_` + 43 URL-safe characters (256 random bits)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def is_well_formed_secret(secret: str) -> bool:
    return bool(_SECRET_RE.match(secret))


def validate_team(team: str) -> str:
    """The one team rule, also the scheduler's for jobs and quotas: a token is never minted for a team
    whose jobs would all be refused."""
    if not contract.TEAM.matches(team):
        raise InvalidArgument(f"team must be {contract.TEAM.rule} (got {team[:80]!r})")
    return team


def validate_user(user: str) -> str:
    if not contract.USER.matches(user):
        raise InvalidArgument(f"user must be {contract.USER.rule} (got {user[:80]!r})")
    return user


def format_time(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """What a token grants; also the authenticated caller of a request. `expires_at` None: never (only
    the bootstrap token of a local cluster and legacy records). `scopes` empty: limited by the role alone."""

    token_id: str
    team: str
    user: str
    role: Role
    created_at: float
    expires_at: float | None = None
    scopes: tuple[Scope, ...] = ()
    description: str = ""
    legacy: bool = False

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def to_json(self) -> bytes:
        data: dict[str, Any] = {"token_id": self.token_id, "team": self.team, "user": self.user,
                                "role": self.role.value, "created_at": self.created_at,
                                "expires_at": self.expires_at, "scopes": [s.value for s in self.scopes],
                                "description": self.description}
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> TokenRecord:
        """ValueError (or KeyError) for a record this version cannot read: an unknown role or scope."""
        data = json.loads(raw)
        token_id, team, user = str(data["token_id"]), str(data["team"]), str(data["user"])
        created_at, description = float(data["created_at"]), str(data.get("description", ""))
        if "role" not in data:  # written before roles: admin → operator, else member; never expires
            return cls(token_id=token_id, team=team, user=user, created_at=created_at, description=description,
                       role=Role.OPERATOR if data.get("admin") else Role.MEMBER, legacy=True)
        expires = data.get("expires_at")
        return cls(token_id=token_id, team=team, user=user, created_at=created_at, description=description,
                   role=Role(data["role"]), expires_at=None if expires is None else float(expires),
                   scopes=tuple(Scope(s) for s in data.get("scopes", ())))


@dataclass(eq=False)
class _Entry:
    """A verified token in the cache: its record, until when it may serve (monotonic seconds), and whether a
    background read of it failed (then it is not read again until a request must: once it has run out)."""

    record: TokenRecord
    until: float
    refresh_failed: bool = False


class TokenStore:
    """Creates, verifies, lists and revokes tokens. Safe for concurrent use from one event loop."""

    def __init__(self, store: Store, prefix: str, *, cache_ttl_s: float = 5.0, clock: Clock | None = None,
                 default_ttl_s: float = contract.ttl_seconds(contract.DEFAULT_TOKEN_TTL),
                 max_ttl_s: float = contract.MAX_TOKEN_TTL_S) -> None:
        base = prefix.rstrip("/") + "/gateway"
        self._by_hash = base + "/tokens/"
        self._by_id = base + "/token-ids/"
        self._store = store
        self._ttl = cache_ttl_s
        self._clock = clock or SystemClock()
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        # secret hash → its cache entry, and the background reads in flight.
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._refreshing: dict[str, asyncio.Task[None]] = {}

    def lifetime(self, ttl: str | None) -> float:
        """Seconds a new token lives: `ttl` ('30d'; None for the default), at most max_ttl_s."""
        if ttl is None or ttl == "":
            return self.default_ttl_s
        try:
            seconds = contract.ttl_seconds(ttl)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if seconds > self.max_ttl_s:  # well formed, but more than this gateway allows: 409, not 400
            most = f"{self.max_ttl_s / contract.DAY_S:g}d"
            raise FailedPrecondition(f"ttl {ttl} is longer than this gateway allows ({most}, the setting "
                                     "token_max_ttl_s)")
        return float(seconds)

    async def create(self, *, team: str, user: str, role: Role = contract.DEFAULT_ROLE, ttl: str | None = None,
                     scopes: tuple[Scope, ...] = (), description: str = "") -> tuple[TokenRecord, str]:
        """A new token; returns its record and the secret, which is not retrievable afterwards."""
        validate_team(team)
        validate_user(user)
        if len(description) > contract.MAX_TOKEN_DESCRIPTION:
            raise InvalidArgument(f"description must be at most {contract.MAX_TOKEN_DESCRIPTION} characters (got "
                                  f"{len(description)})")
        lifetime = self.lifetime(ttl)
        secret = new_secret()
        now = self._clock.now()
        record = TokenRecord(token_id=new_id("tok", now), team=team, user=user, role=role, created_at=now,
                             expires_at=now + lifetime, scopes=scopes, description=description)
        if not await self._insert(hash_secret(secret), record):
            raise Conflict("token id or secret collided with an existing one; retry")
        return record, secret

    async def ensure(self, secret: str, *, team: str, user: str, role: Role,
                     description: str = "") -> TokenRecord:
        """Store a token whose secret was chosen elsewhere (the local cluster's bootstrap token); it does not
        expire. Idempotent: a secret already stored keeps its record."""
        if not is_well_formed_secret(secret):
            raise InvalidArgument(f"token secret must be '{SECRET_PREFIX}' followed by 20-200 URL-safe "
                                  "characters")
        digest = hash_secret(secret)
        record = TokenRecord(token_id=new_id("tok", self._clock.now()), team=validate_team(team),
                             user=validate_user(user), role=role, created_at=self._clock.now(),
                             description=description)
        if await self._insert(digest, record):
            return record
        existing = await self._store.get(self._by_hash + digest)
        if existing is None:
            raise Conflict("token was stored and removed concurrently; retry")
        return TokenRecord.from_json(existing.value)

    async def _insert(self, digest: str, record: TokenRecord) -> bool:
        hash_key, id_key = self._by_hash + digest, self._by_id + record.token_id
        result = await self._store.txn(
            [absent(hash_key), absent(id_key)],
            [Put(hash_key, record.to_json()), Put(id_key, digest.encode())])
        return result.succeeded

    async def authenticate(self, secret: str) -> TokenRecord:
        """The record of a valid secret; Unauthenticated otherwise (the message never echoes it)."""
        if not is_well_formed_secret(secret):
            raise Unauthenticated(f"invalid token: Trainyard tokens start with '{SECRET_PREFIX}'")
        digest = hash_secret(secret)
        now = self._clock.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit.until > now:
            if hit.until - now < self._ttl / 2 and not hit.refresh_failed:
                self._refresh_ahead(digest, hit)
            return self._unexpired(hit.record)
        if hit is not None:
            del self._cache[digest]
        kv = await self._store.get(self._by_hash + digest)
        if kv is None:
            raise Unauthenticated("invalid or revoked token")
        try:
            record = TokenRecord.from_json(kv.value)
        except (ValueError, KeyError) as exc:
            log.error("unreadable token record %s…: %s", digest[:12], exc)
            raise Unauthenticated("this token's record cannot be read by this gateway; ask an operator") from None
        if self._ttl > 0:
            self._cache[digest] = _Entry(record, now + self._ttl)
            while len(self._cache) > _CACHE_MAX:
                self._cache.popitem(last=False)
        return self._unexpired(record)

    def _refresh_ahead(self, digest: str, hit: _Entry) -> None:
        """Read the token's record again in the background, unless a read of it is in flight already."""
        if digest in self._refreshing:
            return
        # A context of its own: the read belongs to no request (the one that started it does not wait for it),
        # so it carries none's trace or request id.
        task = asyncio.create_task(self._refresh(digest, hit), name="token cache refresh",
                                   context=contextvars.Context())
        self._refreshing[digest] = task
        task.add_done_callback(lambda _: self._refreshing.pop(digest, None))

    async def _refresh(self, digest: str, hit: _Entry) -> None:
        began = self._clock.monotonic()
        try:
            kv = await self._store.get(self._by_hash + digest)
        except Exception as exc:  # etcd did not answer: the entry serves out its TTL, then a request reads it
            # Not tried again for this entry: in an outage every request would start (and log) another read.
            hit.refresh_failed = True
            log.warning("token cache: reading token %s… again failed (%s); its entry serves until it runs out",
                        digest[:12], type(exc).__name__)
            return
        if self._cache.get(digest) is not hit:  # revoked through this process, or read anew, meanwhile
            return
        try:
            record = None if kv is None else TokenRecord.from_json(kv.value)
        except (ValueError, KeyError):
            record = None  # a request reads it and says why it cannot be used
        if record is None:
            del self._cache[digest]
        else:
            self._cache[digest] = _Entry(record, began + self._ttl)

    async def close(self) -> None:
        """Stop the background reads in flight (the gateway's stop, before its store closes)."""
        tasks = list(self._refreshing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _unexpired(self, record: TokenRecord) -> TokenRecord:
        if record.expired(self._clock.now()):
            assert record.expires_at is not None
            raise Unauthenticated(f"token expired at {format_time(record.expires_at)}; ask your team admin for a "
                                  "new one")
        return record

    async def list(self, team: str | None = None) -> list[TokenRecord]:
        """Tokens in creation order, optionally of one team."""
        page = await self._store.range(self._by_hash)
        records = []
        for kv in page.kvs:
            try:
                records.append(TokenRecord.from_json(kv.value))
            except (ValueError, KeyError) as exc:
                log.warning("unreadable token record %s left out of the list: %s", kv.key.rsplit("/", 1)[-1][:12],
                            exc)
        if team:
            records = [r for r in records if r.team == team]
        return sorted(records, key=lambda r: (r.created_at, r.token_id))

    async def revoke(self, token_id: str, team: str = "") -> TokenRecord:
        """Delete a token by its public id; NotFound when there is none (already revoked) or, with `team`,
        when it is another team's."""
        id_key = self._by_id + token_id
        kv = await self._store.get(id_key)
        if kv is None:
            raise NotFound(f"token {token_id} not found")
        digest = kv.value.decode()
        hash_key = self._by_hash + digest
        record_kv = await self._store.get(hash_key)
        if record_kv is None:  # revoked concurrently (or half a record): drop what is left
            await self._store.txn([], [Delete(id_key)])
            raise NotFound(f"token {token_id} not found")
        try:
            record = TokenRecord.from_json(record_kv.value)
        except (ValueError, KeyError) as exc:
            raise FailedPrecondition(f"token {token_id}'s record cannot be read by this gateway ({exc}); a newer "
                                     "gateway revokes it") from None
        if team and record.team != team:
            raise NotFound(f"token {token_id} not found")
        await self._store.txn([], [Delete(hash_key), Delete(id_key)])
        self._cache.pop(digest, None)
        return record
