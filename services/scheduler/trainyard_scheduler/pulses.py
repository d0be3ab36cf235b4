"""The leader's end of liveness pulses (`trainyard_core.rpc.pulse`): the open sessions, and the UDP endpoint
that takes the agents' pulses and acknowledges them.

A session is opened by the first `Beat` call after a registration (the connectionless path: one session per
node, replaced by the node's next one and closed by its leaving beat), or by the heartbeat stream of an agent
of an earlier version, closed when that stream ends; the leader's term ending closes them all (`clear`). A
valid pulse is a proof of life of its node (`NodeLiveness.seen`) and is acknowledged to the address it came
from. Nothing else is answered: a datagram for a session that is not open, with a bad MAC, malformed, or
replayed (a sequence not above the last accepted) is counted by reason and dropped, so a stray or forged
datagram costs one lookup and at most one MAC.

The endpoint listens on the gRPC server's host and port number, over UDP (what the agents are told), and takes
what arrived every DRAIN_S. Its receive buffer is made large (`RCVBUF_BYTES`) so the pulses of a drain
interval, or of a moment the event loop is busy, wait in the kernel instead of being dropped; a host whose
`net.core.rmem_max` caps it lower gets a warning saying so (pulses dropped there look like silence).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainyard_core.rpc import pulse

from . import metrics
from .liveness import NodeLiveness

log = logging.getLogger(__name__)

RCVBUF_BYTES = 8 << 20
# A drain answers up to a batch of pulses at once: at 1,500 nodes the default 208 KiB send buffer (each small
# datagram is charged ~1 KiB until the receiver reads it) overflowed and acknowledgements were dropped.
SNDBUF_BYTES = 8 << 20
# How often the endpoint takes what arrived, and the most it takes at once (then the loop runs other work).
DRAIN_S = 0.05
MAX_BATCH = 20_000
# Linux's numbers; not every Python names them.
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
# Below this the kernel may drop pulses (or acknowledgements) of a large fleet during a busy moment of the loop.
BUF_WARN_BYTES = 1 << 20


@dataclass(slots=True)
class _Session:
    node_id: str
    mac: pulse.SessionMac
    last_seq: int = 0
    # Opened by a Beat call (the node's only session), not by a heartbeat stream.
    sole: bool = False


class PulseSessions:
    def __init__(self, liveness: NodeLiveness) -> None:
        self._liveness = liveness
        self._sessions: dict[int, _Session] = {}
        # node → its session opened by a Beat call (a stream's sessions are the stream's to close).
        self._by_node: dict[str, int] = {}
        self._accepted = metrics.PULSES.labels("accepted")
        self._dropped = {why: metrics.PULSES.labels(why)
                         for why in ("unknown_session", "bad_mac", "replayed", "malformed")}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, node_id: str, *, sole: bool = False) -> tuple[int, bytes]:
        """A new session for `node_id`: (its id, its key). `sole`: the node's only session from now on (a
        Beat's: the one it held before, if any, is closed)."""
        if sole:
            self.close(self._by_node.pop(node_id, 0))
        while True:
            ident = secrets.randbits(32)
            if ident and ident not in self._sessions:
                break
        key = secrets.token_bytes(pulse.KEY_BYTES)
        self._sessions[ident] = _Session(node_id, pulse.SessionMac(key), sole=sole)
        if sole:
            self._by_node[node_id] = ident
        metrics.PULSE_SESSIONS.set(len(self._sessions))
        return ident, key

    def holds(self, ident: int, node_id: str) -> bool:
        """Whether session `ident` is open and belongs to `node_id`."""
        session = self._sessions.get(ident)
        return session is not None and session.node_id == node_id

    def close(self, ident: int) -> None:
        session = self._sessions.pop(ident, None)
        if session is not None and self._by_node.get(session.node_id) == ident:
            del self._by_node[session.node_id]
        metrics.PULSE_SESSIONS.set(len(self._sessions))

    def clear(self) -> None:
        """The term ended: no pulse is a proof of life to this replica any more."""
        self._sessions.clear()
        self._by_node.clear()
        metrics.PULSE_SESSIONS.set(0)

    def received(self, data: bytes) -> bytes | None:
        """A datagram arrived: the acknowledgement to send back, or None (dropped)."""
        return self.received_many((data,))[0]

    def received_many(self, datagrams: Sequence[bytes]) -> list[bytes | None]:
        """Each datagram's acknowledgement to send back, or None (dropped), in order. The valid pulses are a
        proof of life each, noted together (one reading of the clock), and every outcome is counted once per
        call: this runs for every agent every second, so nothing is done per datagram that can be done per
        batch."""
        sessions = self._sessions
        acks: list[bytes | None] = []
        alive: list[str] = []
        # Nodes whose Beat-opened session carried its first pulse: the agent holds the session (it got the
        # answer that opened it), so it has found this leader (liveness.held).
        holding: list[str] = []
        malformed = unknown = bad_mac = replayed = 0
        for data in datagrams:
            ident = pulse.peek_session(data)
            if ident is None:
                malformed += 1
                acks.append(None)
                continue
            session = sessions.get(ident)
            if session is None:
                unknown += 1
                acks.append(None)
                continue
            seq = session.mac.pulse_seq(data)
            if seq is None:
                bad_mac += 1
                acks.append(None)
                continue
            if seq <= session.last_seq:
                replayed += 1
                acks.append(None)
                continue
            if session.last_seq == 0 and session.sole:
                holding.append(session.node_id)
            session.last_seq = seq
            alive.append(session.node_id)
            acks.append(session.mac.ack(ident, seq))
        if alive:
            self._liveness.seen_many(alive)
            self._accepted.inc(len(alive))
        if holding:
            self._liveness.held(holding)
        for why, count in (("malformed", malformed), ("unknown_session", unknown), ("bad_mac", bad_mac),
                           ("replayed", replayed)):
            if count:
                self._dropped[why].inc(count)
        return acks


class PulseEndpoint:
    """The UDP socket pulses arrive on, drained every DRAIN_S rather than read on every datagram: a wakeup of
    the event loop per pulse cost ~80 µs of CPU at a thousand pulses a second here, a drained batch ~40 µs
    per pulse all told, and the batch's cost does not grow with its wakeups. A pulse waits at most DRAIN_S in
    the kernel's buffer, which is noise against a 2 s node timeout."""

    def __init__(self, sock: socket.socket, sessions: PulseSessions) -> None:
        self._sock = sock
        self._sessions = sessions
        self._task: asyncio.Task[None] | None = None
        self._acks_dropped = metrics.PULSE_ACKS_DROPPED

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pulse endpoint")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._sock.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(DRAIN_S)
            try:
                self.drain()
            except Exception:
                # A bug here must not stop every node's liveness for good: log it and drain again next time.
                log.exception("pulse endpoint: draining failed")

    def drain(self) -> int:
        """Take every datagram waiting (at most MAX_BATCH), then answer the valid pulses among them. Returns how
        many were read."""
        sock = self._sock
        datagrams: list[bytes] = []
        senders: list[Any] = []
        for _ in range(MAX_BATCH):
            try:
                data, addr = sock.recvfrom(64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # an ICMP error for an earlier acknowledgement (an agent gone): nothing to do
                continue
            datagrams.append(data)
            senders.append(addr)
        if not datagrams:
            return 0
        for ack, addr in zip(self._sessions.received_many(datagrams), senders, strict=True):
            if ack is not None:
                try:
                    sock.sendto(ack, addr)
                except OSError:  # the send buffer is full, or no route back: the agent sends again
                    self._acks_dropped.inc()
        return len(datagrams)


def _socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host or ("::" if family == socket.AF_INET6 else "0.0.0.0")
    infos = socket.getaddrinfo(bind_host, port, family=0 if host else family, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        for force, plain, size, what, cap in ((_SO_RCVBUFFORCE, socket.SO_RCVBUF, RCVBUF_BYTES, "receive", "rmem_max"),
                                              (_SO_SNDBUFFORCE, socket.SO_SNDBUF, SNDBUF_BYTES, "send", "wmem_max")):
            try:  # root (CAP_NET_ADMIN) may go past net.core.[rw]mem_max
                sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, plain, size)
            got = sock.getsockopt(socket.SOL_SOCKET, plain)
            if got < BUF_WARN_BYTES:
                log.warning("the pulse endpoint's %s buffer is %d bytes (net.core.%s caps it); pulses or their "
                            "acknowledgements may be dropped for a large fleet while the scheduler is busy: raise "
                            "it with `sysctl -w net.core.%s=%d`", what, got, cap, cap, size)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def start_endpoint(host: str, port: int, sessions: PulseSessions) -> PulseEndpoint:
    """Listen for pulses on `host`:`port` (UDP; the gRPC server's own host and port number)."""
    try:
        sock = _socket(host, port)
    except OSError as exc:
        raise OSError(f"cannot listen for liveness pulses on UDP {host or '*'}:{port} (the gRPC port's number, "
                      f"which agents send their pulses to): {exc}") from exc
    endpoint = PulseEndpoint(sock, sessions)
    endpoint.start()
    return endpoint
