"""Server-sent events: the one wire format of the gateway's streams (`?follow=true`, `?watch=true`).

Each event is `id: <id>`, `event: <kind>`, one `data:` line of compact JSON, and a blank line
(https://html.spec.whatwg.org/multipage/server-sent-events.html). Ids are opaque to clients: a client that
lost its connection sends the last one it saw back as the `Last-Event-ID` header (or `?last_event_id=`,
for clients that cannot set headers) and the stream resumes after it. A comment line (`: keepalive`) goes
out every `KEEPALIVE_S` while nothing else does, so proxies and load balancers with idle timeouts keep the
connection, and the server notices a client that went away.

`event_stream(events)` wraps an async iterator of `Event` in the streaming response: media type
`text/event-stream`, no caching, no proxy buffering (`X-Accel-Buffering: no`). The iterator ends the
stream by returning; the server closes it (and the iterator) when the client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

MEDIA_TYPE = "text/event-stream"
KEEPALIVE_S = 15.0
LAST_EVENT_ID_HEADER = "Last-Event-ID"
HEADERS: Mapping[str, str] = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# An event id: what a client may send back. Printable ASCII without the characters SSE gives meaning to.
EVENT_ID_PATTERN = r"^[\x21-\x7e]{0,256}$"


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    data: Mapping[str, Any]
    id: str = ""


def encode(event: Event) -> bytes:
    """One event on the wire. Pure. JSON keeps the data on one line (newlines in strings are escaped)."""
    out = []
    if event.id:
        out.append(f"id: {event.id}\n")
    out.append(f"event: {event.kind}\n")
    out.append("data: " + json.dumps(event.data, separators=(",", ":"), ensure_ascii=False,
                                     default=str) + "\n\n")
    return "".join(out).encode()


KEEPALIVE = b": keepalive\n\n"


async def with_keepalive(events: AsyncIterator[Event], interval_s: float = KEEPALIVE_S) -> AsyncIterator[bytes]:
    """The encoded events, with a keepalive comment after every `interval_s` without one. The source is
    closed when the consumer stops (the client went away)."""
    source = aiter(events)
    pending: asyncio.Task[Event] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                event = task.result()
            except StopAsyncIteration:
                return
            yield encode(event)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        closer = getattr(source, "aclose", None)
        if closer is not None:
            await closer()


def event_stream(events: AsyncIterator[Event], *, interval_s: float = KEEPALIVE_S,
                 on_close: Callable[[], object] | None = None) -> StreamingResponse:
    """`on_close`, when given, runs once the response is over (finished, or the client went away): a second
    line of defence that a stream's own work is stopped even if closing its iterator was cut short."""
    return StreamingResponse(with_keepalive(events, interval_s), media_type=MEDIA_TYPE, headers=dict(HEADERS),
                             background=BackgroundTask(on_close) if on_close is not None else None)
