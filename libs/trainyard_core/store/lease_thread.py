"""A leader's lease, renewed from a thread of its own, so that its own event loop being busy does not end it.

A leader's event loop runs everything the leader does, in the order the steps became ready. When every agent of
a large fleet registers with a new leader at once (a failover), thousands of steps are ready at any moment and
each waits behind the others: the lease keepalive's too. With a 3 s lease, a loop that takes a second or more
to come round (measured at 5,000 simulated agents on 2 cores, bench/fleet) lets the lease expire, or its
answers arrive after their deadline and the store looks unreachable. The leader then steps down, every agent
looks for the next one at once, and the storm starts again with it (seen: six leaders in a minute).

So the lease is renewed here, by a thread with its own blocking gRPC channel to etcd (the asyncio one is the
loop's), every third of the lease's TTL; a renewal may take as long as is left before the lease could expire,
and one that fails is tried again at once on the next member. The thread does not keep a leader whose loop
has stopped: the loop notes every pass of a task of the election's (`loop_alive`), and when none came for
`stall_s` (a process that hangs, not one that is busy) the thread stops renewing, so the lease expires and a
standby takes over. It ends leadership (`on_lost`, called in the thread: the caller hands it to its loop)
when etcd says the lease is gone (TTL 0), and when no renewal sent within the last TTL was answered (the store
unreachable: a partitioned leader steps down, so its agents look for the next one). What a renewal proves is
counted from when it was sent, not when its answer was read.

Connection: the store's endpoints, moved to the next on a failure; the same TLS files and, with password
authentication, its own login token (renewed when etcd no longer knows it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from aetcd import rpc

from .etcd_client import channel_credentials
from .etcd_options import EtcdOptions

log = logging.getLogger(__name__)

# A loop that has not come round for this long is stuck, not busy: its lease is left to expire.
LOOP_STALL_S = 10.0
# After a renewal that failed, the next (on the next member) is tried this soon.
RETRY_S = 0.1


class ThreadLeaseKeeper:
    def __init__(self, *, endpoints: Sequence[tuple[str, int]], options: EtcdOptions, lease_id: int, ttl_s: float,
                 loop_alive: Callable[[], float], on_lost: Callable[[str], None], stall_s: float = LOOP_STALL_S,
                 first: int = 0) -> None:
        """`loop_alive()`: the monotonic time the owner's event loop last came round; `first`: the endpoint to
        start with (the one the owner's store uses)."""
        self._endpoints = list(endpoints)
        self._options = options
        self._lease = lease_id
        self._ttl = ttl_s
        self._loop_alive = loop_alive
        self._on_lost = on_lost
        self._stall = stall_s
        self._current = first % len(self._endpoints)
        self._channel: grpc.Channel | None = None
        self._token: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease keeper {lease_id:x}", daemon=True)
        self.renewals = 0  # answered renewals (tests read it)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the owner resigns or lost leadership); it never blocks the caller's loop: a renewal in
        flight may still be sent, and one sent after the lease was revoked is answered TTL 0."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end (tests); True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        confirmed = time.monotonic()  # the lease was alive when the last answered renewal was sent
        due = confirmed + self._ttl / 3
        failure = ""
        try:
            while not self._stop.wait(max(0.0, due - time.monotonic())):
                sent = time.monotonic()
                if sent - self._loop_alive() > self._stall:
                    self._lost(f"the event loop has not run for {sent - self._loop_alive():.1f}s; the lease is "
                               "left to expire so that a standby takes over")
                    return
                # A renewal may take as long as is left before the lease could have expired unrenewed: on a
                # machine saturated by a storm, etcd's answer can take a second and still be in time.
                left_s = confirmed + self._ttl - sent
                if left_s <= 0:
                    self._lost(f"store unreachable for {self._ttl:g}s: {failure}")
                    return
                try:
                    left = self._renew(left_s)
                except grpc.RpcError as exc:
                    left, failure = None, _describe(exc)
                except Exception as exc:  # e.g. TLS files unreadable mid-rotation: a failed renewal, not the end
                    left, failure = None, f"{type(exc).__name__}: {exc}"
                else:
                    if left is None:
                        failure = "the lease keepalive stream ended without an answer"
                if left is None:
                    self._next_endpoint()
                    due = time.monotonic() + RETRY_S
                    continue
                if left <= 0:
                    self._lost("lease expired")
                    return
                confirmed = sent
                due = sent + self._ttl / 3
                self.renewals += 1
        finally:
            self._close()

    def _lost(self, why: str) -> None:
        if not self._stop.is_set():
            self._on_lost(why)

    def _metadata(self, channel: grpc.Channel, timeout: float) -> tuple[tuple[str, str], ...] | None:
        if self._options.auth_mode != "password":
            return None
        if self._token is None:
            assert self._options.password is not None
            answer = rpc.AuthStub(channel).Authenticate(rpc.AuthenticateRequest(
                name=self._options.user, password=self._options.password.get_secret_value()), timeout=timeout)
            self._token = answer.token
        return (("token", self._token),)

    def _renew(self, timeout: float) -> int | None:
        """One keepalive; the TTL etcd answers (0: the lease is gone; None: no answer)."""
        channel = self._connect()
        try:
            return self._keepalive(channel, timeout)
        except grpc.RpcError as exc:
            if self._token is not None and "invalid auth token" in (_details(exc) or ""):
                self._token = None  # etcd restarted or the token expired: log in again, once
                return self._keepalive(channel, timeout)
            raise

    def _keepalive(self, channel: grpc.Channel, timeout: float) -> int | None:
        answers = rpc.LeaseStub(channel).LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=self._lease)]),
                                                         timeout=timeout, metadata=self._metadata(channel, timeout))
        try:
            for answer in answers:
                return int(answer.TTL)
        finally:
            answers.cancel()
        return None

    def _connect(self) -> grpc.Channel:
        if self._channel is None:
            host, port = self._endpoints[self._current]
            target = f"{host}:{port}"
            if self._options.tls:
                self._channel = grpc.secure_channel(target, channel_credentials(self._options))
            else:
                self._channel = grpc.insecure_channel(target)
        return self._channel

    def _next_endpoint(self) -> None:
        self._close()
        self._token = None
        self._current = (self._current + 1) % len(self._endpoints)

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _details(exc: grpc.RpcError) -> str | None:
    details = getattr(exc, "details", None)
    return details() if callable(details) else None


def _describe(exc: grpc.RpcError) -> str:
    code = getattr(exc, "code", None)
    name = code().name if callable(code) else type(exc).__name__
    return f"{name}: {_details(exc) or ''}"
