"""A stream of server-sent events that survives dropped connections: `EventStream` (sync) and
`AsyncEventStream`, the same loop twice over the two kinds of I/O (everything it decides is `wire.Resume`'s and
`sse.SseDecoder`'s, both pure).

The loop: connect (with `Last-Event-ID` once an event had an id), feed every chunk to a decoder, hand each
event the call decodes to the caller. It ends after the event the call calls final (`event: end`); a stream
without one (a watch of jobs) lasts until the caller closes it. A connection that drops mid-stream, cannot be
made, answers 503/429, or ends before the final event (the gateway restarting) is made again after
`Resume.dropped`'s delay, from the last event id, so the caller sees each event once and in order (the gateway
resumes after the id it is sent); another refusal (404, 403, ...) is raised as its ApiError, and so is the last
failure once `Reconnect.max_failures` attempts in a row brought no event.

A stream is an iterator and a context manager: leaving the `with` block (or `close()`) closes the connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterator
from types import TracebackType
from typing import Generic, NoReturn, TypeVar

from .errors import ConnectionFailed, SdkError
from .sse import SseDecoder, SseEvent
from .wire import Reconnect, Request, Resume, StreamCall

T = TypeVar("T")
# connect(request): a context manager over the answer's body chunks, raising ApiError for an error answer and
# ConnectionFailed for a transport failure (at connect time or while reading).
SyncConnect = Callable[[Request], contextlib.AbstractContextManager[Iterator[bytes]]]
AsyncConnect = Callable[[Request], contextlib.AbstractAsyncContextManager[AsyncIterator[bytes]]]
# Told before each reconnect: why the connection ended, and the seconds the stream waits before the next one.
OnReconnect = Callable[[SdkError, float], None]


def _reraise(error: SdkError) -> NoReturn:
    raise error


def _events(decoder: SseDecoder, chunks: Iterator[bytes]) -> Iterator[SseEvent]:
    for chunk in chunks:
        yield from decoder.feed(chunk)
    yield from decoder.close()


async def _aevents(decoder: SseDecoder, chunks: AsyncIterator[bytes]) -> AsyncGenerator[SseEvent, None]:
    async for chunk in chunks:
        for event in decoder.feed(chunk):
            yield event
    for event in decoder.close():
        yield event


class EventStream(Generic[T]):
    def __init__(self, call: StreamCall[T], connect: SyncConnect, *, url: str, reconnect: Reconnect,
                 sleep: Callable[[float], None], failed: Callable[[SdkError], NoReturn] = _reraise,
                 on_reconnect: OnReconnect | None = None) -> None:
        self._url = url
        self._failed = failed
        self._call = call
        self._connect = connect
        self._sleep = sleep
        self._on_reconnect = on_reconnect
        self.resume = Resume(reconnect, last_event_id=call.last_event_id)
        self._events = self._run()

    @property
    def last_event_id(self) -> str:
        """The id of the last event seen: pass it as `last_event_id=` to a new stream to resume after it."""
        return self.resume.last_event_id

    def _run(self) -> Generator[T, None, None]:
        call, resume = self._call, self.resume
        while True:
            try:
                with self._connect(resume.request(call.request)) as chunks:
                    decoder = SseDecoder(resume.last_event_id)
                    for event in _events(decoder, chunks):
                        resume.seen(event, decoder.retry_ms)
                        item = call.decode(event)
                        if item is not None:
                            yield item
                        if call.final(event):
                            return
                # A complete answer without the stream's last event: the gateway went away (a restart ends
                # streams cleanly), so it is taken up again like a dropped connection.
                raise ConnectionFailed(f"the gateway at {self._url} ended the stream before its end", url=self._url)
            except SdkError as error:
                delay = resume.dropped(error)
                if delay is None:
                    self._failed(error)
                if self._on_reconnect is not None:
                    self._on_reconnect(error, delay)
            self._sleep(delay)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def __enter__(self) -> EventStream[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncEventStream(Generic[T]):
    def __init__(self, call: StreamCall[T], connect: AsyncConnect, *, url: str, reconnect: Reconnect,
                 sleep: Callable[[float], Awaitable[None]], failed: Callable[[SdkError], NoReturn] = _reraise,
                 on_reconnect: OnReconnect | None = None) -> None:
        self._url = url
        self._failed = failed
        self._call = call
        self._connect = connect
        self._sleep = sleep
        self._on_reconnect = on_reconnect
        self.resume = Resume(reconnect, last_event_id=call.last_event_id)
        self._events = self._run()

    @property
    def last_event_id(self) -> str:
        return self.resume.last_event_id

    async def _run(self) -> AsyncGenerator[T, None]:
        call, resume = self._call, self.resume
        while True:
            try:
                async with self._connect(resume.request(call.request)) as chunks:
                    decoder = SseDecoder(resume.last_event_id)
                    async with contextlib.aclosing(_aevents(decoder, chunks)) as events:
                        async for event in events:
                            resume.seen(event, decoder.retry_ms)
                            item = call.decode(event)
                            if item is not None:
                                yield item
                            if call.final(event):
                                return
                # A complete answer without the stream's last event: the gateway went away (a restart ends
                # streams cleanly), so it is taken up again like a dropped connection.
                raise ConnectionFailed(f"the gateway at {self._url} ended the stream before its end", url=self._url)
            except SdkError as error:
                delay = resume.dropped(error)
                if delay is None:
                    self._failed(error)
                if self._on_reconnect is not None:
                    self._on_reconnect(error, delay)
            await self._sleep(delay)

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self._events.aclose()

    async def __aenter__(self) -> AsyncEventStream[T]:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
