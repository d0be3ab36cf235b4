"""The reconnect loop of `EventStream` and `AsyncEventStream` over scripted connections (each a list of byte
chunks, then a clean end or a failure): what a dropped connection, a stream that ends before its last event, a
refusal and a run of failures do, the delays between attempts and the Last-Event-ID sent. The end-to-end
counterpart, with the real gateway and a connection cut for real, is test_streams.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from trainyard_sdk.errors import ConnectionFailed, NotFound, SdkError, Unavailable
from trainyard_sdk.sse import SseEvent
from trainyard_sdk.streaming import AsyncEventStream, EventStream
from trainyard_sdk.wire import Reconnect, Request, StreamCall

DROP = ConnectionFailed("lost", url="http://gw")
Script = list[bytes | SdkError] | SdkError
CALL = StreamCall(Request("GET", "/v1/jobs/j/logs", params=(("follow", "true"),)), lambda e: (e.event, e.data, e.id),
                  final=lambda e: e.event == "end")


def line(n: int) -> bytes:
    return f"id: p{n}\nevent: line\ndata: {n}\n\n".encode()


END = b"event: end\ndata: {}\n\n"


class Scripted:
    """Connections that answer `scripts` in turn; `requests` are what they were asked, `slept` the delays."""

    def __init__(self, *scripts: Script) -> None:
        self.scripts = list(scripts)
        self.requests: list[Request] = []
        self.slept: list[float] = []

    def _next(self, request: Request) -> list[bytes | SdkError]:
        self.requests.append(request)
        script = self.scripts.pop(0)
        if isinstance(script, SdkError):
            raise script
        return script

    @contextlib.contextmanager
    def connect(self, request: Request) -> Iterator[Iterator[bytes]]:
        script = self._next(request)

        def chunks() -> Iterator[bytes]:
            for part in script:
                if isinstance(part, SdkError):
                    raise part
                yield part

        yield chunks()

    @contextlib.asynccontextmanager
    async def aconnect(self, request: Request) -> AsyncIterator[AsyncIterator[bytes]]:
        script = self._next(request)

        async def chunks() -> AsyncIterator[bytes]:
            for part in script:
                if isinstance(part, SdkError):
                    raise part
                yield part

        yield chunks()

    def sleep(self, delay: float) -> None:
        self.slept.append(delay)

    async def asleep(self, delay: float) -> None:
        self.slept.append(delay)

    def last_event_ids(self) -> list[str | None]:
        return [dict(r.headers).get("Last-Event-ID") for r in self.requests]


async def read(flavour: str, scripted: Scripted, call: StreamCall[Any] = CALL,
               reconnect: Reconnect = Reconnect(max_failures=3, backoff_s=0.5, max_delay_s=10),
               on_reconnect: Any = None) -> list[Any]:
    if flavour == "sync":
        with EventStream(call, scripted.connect, url="http://gw", reconnect=reconnect, sleep=scripted.sleep,
                         on_reconnect=on_reconnect) as s:
            return list(s)
    async with AsyncEventStream(call, scripted.aconnect, url="http://gw", reconnect=reconnect,
                                sleep=scripted.asleep, on_reconnect=on_reconnect) as stream:
        return [item async for item in stream]


FLAVOURS = pytest.mark.parametrize("flavour", ["sync", "async"])


@FLAVOURS
async def test_a_dropped_connection_resumes_after_the_last_event(flavour: str) -> None:
    scripted = Scripted([line(1), line(2)[:9], DROP], [line(2), line(3)[:5], line(3)[5:] + END])
    got = await read(flavour, scripted)
    assert got == [("line", "1", "p1"), ("line", "2", "p2"), ("line", "3", "p3"), ("end", "{}", "p3")]
    assert scripted.last_event_ids() == [None, "p1"]  # the half-sent second event is sent again, whole
    assert scripted.slept == [0.5]


@FLAVOURS
async def test_the_stream_ends_at_its_final_event_and_not_before(flavour: str) -> None:
    # The first answer ends cleanly without `end` (a gateway restarting): taken up again, from p1.
    scripted = Scripted([line(1)], [END, line(9)])
    got = await read(flavour, scripted)
    assert got == [("line", "1", "p1"), ("end", "{}", "p1")]  # nothing after the final event is read
    assert scripted.last_event_ids() == [None, "p1"]


@FLAVOURS
async def test_failures_in_a_row_give_up_and_an_event_starts_the_count_again(flavour: str) -> None:
    busy = Unavailable(503, "unavailable", "no scheduler", retry_after=1)
    scripted = Scripted(DROP, [line(1), DROP], DROP, busy, DROP)
    with pytest.raises(ConnectionFailed):
        await read(flavour, scripted)
    # The backoff, started again after p1 and doubling; a 503's Retry-After; the fourth failure in a row is raised.
    assert scripted.slept == [0.5, 0.5, 1.0, 1.0]
    assert not scripted.scripts


@FLAVOURS
async def test_on_reconnect_is_told_why_and_how_long_before_each_reconnect_and_not_before_giving_up(
        flavour: str) -> None:
    busy = Unavailable(503, "unavailable", "no scheduler", retry_after=1)
    scripted = Scripted([line(1), DROP], busy, DROP, DROP)
    told: list[tuple[SdkError, float, int]] = []
    with pytest.raises(ConnectionFailed):
        await read(flavour, scripted,
                   on_reconnect=lambda error, delay: told.append((error, delay, len(scripted.slept))))
    # Each before its wait (nothing slept yet for it); the fourth failure in a row is raised, not announced.
    assert told == [(DROP, 0.5, 0), (busy, 1.0, 1), (DROP, 2.0, 2)]
    assert scripted.slept == [0.5, 1.0, 2.0]


@FLAVOURS
async def test_the_servers_retry_field_sets_the_delay(flavour: str) -> None:
    scripted = Scripted([b"retry: 2000\n" + line(1), DROP], [END])
    assert await read(flavour, scripted) == [("line", "1", "p1"), ("end", "{}", "p1")]
    assert scripted.slept == [2.0]


@FLAVOURS
async def test_a_refusal_is_raised_at_once(flavour: str) -> None:
    scripted = Scripted(NotFound(404, "not_found", "job j not found"))
    with pytest.raises(NotFound):
        await read(flavour, scripted)
    assert len(scripted.requests) == 1 and scripted.slept == []


@FLAVOURS
async def test_events_of_kinds_the_call_does_not_know_are_passed_over(flavour: str) -> None:
    call = StreamCall(CALL.request, lambda e: e.data if e.event == "line" else None, final=CALL.final,
                      last_event_id="p0")
    scripted = Scripted([b": keepalive\n\nevent: someday\ndata: x\n\n", line(1), END])
    assert await read(flavour, scripted, call) == ["1"]
    assert scripted.last_event_ids() == ["p0"]  # a stream started where another one left off


def test_closing_a_stream_that_was_never_read_opens_nothing() -> None:
    scripted = Scripted()
    EventStream(CALL, scripted.connect, url="http://gw", reconnect=Reconnect(), sleep=scripted.sleep).close()
    assert scripted.requests == []
    assert SseEvent("line", "x").id == ""
