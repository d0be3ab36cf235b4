"""Liveness pulses: the datagrams that prove an agent alive to the scheduler leader (docs/architecture.md,
"Node liveness"). Pure: the wire format, its authentication, and the timing both ends and the worker-fence
arithmetic depend on.

Why datagrams: a leader holding 10,000 nodes cannot afford per-connection HTTP/2 keepalive at the rate a 2 s
detection needs (gRPC's C core spent ~184 µs per connection-second on 1 s pings over TLS, bench/fleet); a
pulse costs the leader one `recvfrom`, one keyed BLAKE2s and one `sendto`.

A pulse session belongs to one registration of a node (or, for agents of earlier versions, to one heartbeat
stream). The leader opens it when the first beat asks for pulses and hands the agent, in its answer over
mTLS, a random 32-bit session id and a random 32-byte key. The
agent then sends a PULSE every `PULSE_INTERVAL_S` to the same host and port as the stream (UDP), and once
more `RETRY_AFTER_S` later when the first was not acknowledged by then; the leader answers each valid one with
an ACK. The session ends with the agent's leaving beat, its next registration, the stream it came with, or the
leader's term, and with it every pulse that names it.

    offset  size  field
    0       1     version (1)
    1       1     kind: 1 PULSE (agent → leader), 2 ACK (leader → agent)
    2       4     session id (big-endian)
    6       8     sequence: the agent's counter, strictly increasing within a session; an ACK repeats the
                  sequence of the pulse it answers
    14      16    BLAKE2s-128 of bytes 0-13, keyed with the session key

A datagram of any other size, version or kind, for an unknown session, with a wrong MAC, or (a pulse) with a
sequence not above the last one accepted is dropped without an answer. The kind byte is inside the MAC, so
a pulse cannot be reflected as an acknowledgement.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import dataclass

VERSION = 1
PULSE = 1
ACK = 2
KEY_BYTES = 32
MAC_BYTES = 16
_HEAD = struct.Struct("!BBIQ")
SIZE = _HEAD.size + MAC_BYTES

# An agent pulses this often. A pulse not acknowledged within RETRY_AFTER_S is sent once more (a new sequence),
# so a pulse or an acknowledgement lost on the network costs half an interval, not a whole one, and the
# leader's work per node is one pulse and one acknowledgement a second while nothing is lost (it was two of
# each at 0.5 s: the leader's main per-node cost, bench/fleet). With the scheduler's default node_timeout_s
# (2.5 s) a node is lost only after two pulses in a row and both their retries went missing, and a silent host
# is noticed 1.5 to 2.5 s after it went silent.
PULSE_INTERVAL_S = 1.0
RETRY_AFTER_S = 0.5
# An agent renews its worker lease only while the newest pulse the leader acknowledged was sent at most this
# long ago (by the agent's clock): the leader's last proof of life from the node is never older than that
# pulse, so workers outlive the leader's last proof by at most this plus one renewal period plus the lease.
ACK_WINDOW_S = 2.0
# An agent whose pulses went unacknowledged this long (counted from the send time of the newest one the leader
# acknowledged, or from the start of the session) ends its stream and looks for the leader again: the leader
# is gone, unreachable, or stopped for longer than its own lease lets it stay leader (leader_ttl_s, 3 s by
# default). This, not HTTP/2 keepalive, is how an agent notices a leader that went silent.
RECONNECT_AFTER_S = 4.0


@dataclass(frozen=True, slots=True)
class Datagram:
    kind: int
    session: int
    seq: int


def _mac(key: bytes, head: bytes) -> bytes:
    return hashlib.blake2s(head, key=key, digest_size=MAC_BYTES).digest()


def _frame(kind: int, session: int, seq: int, mac: Callable[[bytes], bytes]) -> bytes:
    head = _HEAD.pack(VERSION, kind, session, seq)
    return head + mac(head)


def _checked(data: bytes, kind: int, mac: Callable[[bytes], bytes]) -> tuple[int, int] | None:
    """(session, seq) of `data` if it is a well-formed `kind` whose MAC is `mac`'s of its head; None otherwise."""
    if len(data) != SIZE:
        return None
    head = data[:_HEAD.size]
    version, got_kind, session, seq = _HEAD.unpack(head)
    if version != VERSION or got_kind != kind or not hmac.compare_digest(mac(head), data[_HEAD.size:]):
        return None
    return session, seq


def encode(kind: int, session: int, seq: int, key: bytes) -> bytes:
    return _frame(kind, session, seq, functools.partial(_mac, key))


def peek_session(data: bytes) -> int | None:
    """The session a datagram names, if it has the shape of one (nothing is verified yet)."""
    if len(data) != SIZE or data[0] != VERSION:
        return None
    return int.from_bytes(data[2:6], "big")


class SessionMac:
    """One session's key, keyed into BLAKE2s once: each datagram's MAC is a copy of that state fed the
    14-byte head (keying compresses a whole block for the key, every time). For the leader, which checks and
    answers every agent's pulses; the wire format is `encode`'s and `verify`'s."""

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes) -> None:
        self._keyed = hashlib.blake2s(key=key, digest_size=MAC_BYTES)

    def _mac(self, head: bytes) -> bytes:
        state = self._keyed.copy()
        state.update(head)
        return state.digest()

    def pulse_seq(self, data: bytes) -> int | None:
        """The sequence of `data` if it is a well-formed PULSE under this key, else None (`verify` without a
        Datagram made per datagram)."""
        got = _checked(data, PULSE, self._mac)
        return None if got is None else got[1]

    def ack(self, session: int, seq: int) -> bytes:
        """`encode(ACK, session, seq, key)`."""
        return _frame(ACK, session, seq, self._mac)


def verify(data: bytes, key: bytes, kind: int) -> Datagram | None:
    """The datagram if it is a well-formed `kind` authenticated by `key`; None otherwise."""
    got = _checked(data, kind, functools.partial(_mac, key))
    return None if got is None else Datagram(kind, *got)
