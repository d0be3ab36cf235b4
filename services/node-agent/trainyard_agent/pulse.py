"""The agent's end of liveness pulses (`trainyard_core.rpc.pulse`): one `Pulser` per session
the leader opened for this agent.

It sends a pulse every interval to the host and port the agent registered with (UDP, from a socket connected to that
address, so only datagrams from there are read), once more RETRY_AFTER_S later when that one was not
acknowledged by then, and reads the leader's acknowledgements. `fresh()` says
whether the newest acknowledged pulse was sent within ACK_WINDOW_S: the worker lease is renewed only then,
because the leader has heard from this node at least that recently. When nothing was acknowledged for
RECONNECT_AFTER_S (since the newest acknowledged pulse was sent, or since the pulser started) it calls
`on_silent` once: the reporter then ends the session and looks for the leader again. A send that fails (no
route, the leader's port closed) is retried with the next pulse.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.clock import Clock
from trainyard_core.rpc import pulse
from trainyard_core.waits import cancel_and_wait

log = logging.getLogger(__name__)

# Sends whose time is still remembered (an acknowledgement for an older pulse is ignored): ACK_WINDOW_S
# worth of pulses is all that `fresh` looks at.
_REMEMBERED = 64


def split_target(target: str) -> tuple[str, int]:
    """host:port (or [v6]:port) → (host, port)."""
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, pulser: Pulser) -> None:
        self._pulser = pulser

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self._pulser._acked(data)

    def error_received(self, exc: Exception) -> None:
        # ICMP "port unreachable" for an earlier pulse (the leader's process is gone): the pulses going
        # unacknowledged say so.
        self._pulser.send_errors += 1


class Pulser:
    def __init__(self, *, host: str, port: int, session: int, key: bytes, interval_s: float,
                 clock: Clock, on_silent: Callable[[], None] | None = None) -> None:
        self._addr = (host, port)
        self._session = session
        self._key = key
        self._interval = interval_s
        self._clock = clock
        self._on_silent = on_silent
        self._detached = False
        self._started_at = clock.monotonic()
        self._transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self._sent_at: dict[int, float] = {}
        self._acked_seq = 0
        # Monotonic time the newest acknowledged pulse was sent at (-inf: none yet).
        self.acked_sent_at = float("-inf")
        self.sent = 0
        self.retries = 0
        self.acks = 0
        self.send_errors = 0

    @classmethod
    def for_session(cls, target: str, answer: scheduler_pb2.HeartbeatResponse, clock: Clock,
                    on_silent: Callable[[], None] | None = None) -> Pulser:
        """The pulser of the session a first beat's answer opened, towards the scheduler's host:port."""
        host, port = split_target(target)
        interval = answer.pulse_interval_ms / 1000 if answer.pulse_interval_ms > 0 else pulse.PULSE_INTERVAL_S
        return cls(host=host, port=port, session=answer.pulse_session, key=answer.pulse_key, interval_s=interval,
                   clock=clock, on_silent=on_silent)

    @property
    def session(self) -> int:
        return self._session

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self), remote_addr=self._addr)
        self._task = asyncio.create_task(self._run(), name="liveness-pulses")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def detach(self) -> None:
        """The session is over for the agent, which registers again (`Reporter`), but its pulses may still reach a
        leader that holds it: they go on, once an interval (no second send when one is not acknowledged, since
        most reach a leader that is gone), and `on_silent` is no longer called."""
        self._on_silent = None
        self._detached = True

    def fresh(self) -> bool:
        """The leader acknowledged a pulse sent within ACK_WINDOW_S."""
        return self._clock.monotonic() - self.acked_sent_at <= pulse.ACK_WINDOW_S

    def silent_for(self) -> float:
        """Seconds since the newest acknowledged pulse was sent (or since the start, before any)."""
        return self._clock.monotonic() - max(self.acked_sent_at, self._started_at)

    async def _run(self) -> None:
        silent_called = False
        retry_after = min(pulse.RETRY_AFTER_S, self._interval / 2)
        while True:
            self._send()
            await asyncio.sleep(retry_after)
            if self._acked_seq < self._seq and not self._detached:
                # Not acknowledged yet: the pulse or its answer was lost (or the leader is slow). Once more now,
                # rather than a whole interval later.
                self._send()
                self.retries += 1
            await asyncio.sleep(self._interval - retry_after)
            if not silent_called and self._on_silent is not None and self.silent_for() > pulse.RECONNECT_AFTER_S:
                silent_called = True
                self._on_silent()

    def _send(self) -> None:
        if self._transport is None:
            return
        self._seq += 1
        self._sent_at[self._seq] = self._clock.monotonic()
        if len(self._sent_at) > _REMEMBERED:
            del self._sent_at[next(iter(self._sent_at))]
        try:
            self._transport.sendto(pulse.encode(pulse.PULSE, self._session, self._seq, self._key))
            self.sent += 1
        except OSError as exc:
            self.send_errors += 1
            log.debug("liveness pulse not sent: %s", exc)

    def _acked(self, data: bytes) -> None:
        got = pulse.verify(data, self._key, pulse.ACK)
        if got is None or got.session != self._session or got.seq <= self._acked_seq:
            return
        sent_at = self._sent_at.get(got.seq)
        if sent_at is None:  # not one of ours, or too old to matter
            return
        self._acked_seq = got.seq
        self.acked_sent_at = max(self.acked_sent_at, sent_at)
        self.acks += 1
