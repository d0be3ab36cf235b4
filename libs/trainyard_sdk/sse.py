"""A server-sent events decoder: bytes as they arrive in, whole events out. Pure (no I/O, no clock).

The rules are the WHATWG "event stream interpretation"
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation): UTF-8, an
optional byte order mark first, lines ended by CRLF, LF or CR; `field: value` lines (one space after the colon
dropped), `:` comment lines ignored (the gateway's `: keepalive`), a blank line dispatching the event built so
far. `data` lines join with newlines; `event` names the kind (default "message"); `id` sets the last event id,
which an event keeps even when it names none (what a client sends back as `Last-Event-ID`); `retry` sets the
reconnection delay. An event with no data is not dispatched (but its id counts), and what is left at the end of
the stream without its blank line is dropped.

Chunks may split the stream anywhere (inside a UTF-8 sequence, between the CR and LF of one line ending): the
decoder keeps what it cannot decide yet, so any chunking of a stream gives the same events
(tests/sdk/test_sse.py holds it to that with hypothesis). The gateway's encoder is `trainyard_gateway.sse`.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

_EOL = re.compile(r"\r\n|\r|\n")
_BOM = "\ufeff"


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str
    data: str
    id: str = ""


class SseDecoder:
    """Feed it chunks, get events. `last_event_id` and `retry_ms` are the stream's state as of the last line
    read. Not thread-safe: one decoder per connection."""

    def __init__(self, last_event_id: str = "") -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._started = False
        self._data: list[str] = []
        self._kind = ""
        self.last_event_id = last_event_id
        self.retry_ms: int | None = None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        return self._text(self._utf8.decode(chunk), final=False)

    def close(self) -> list[SseEvent]:
        """The end of the stream: a last line ended by a lone CR is read; an event without its blank line is
        dropped (the spec's rule: it may be cut short)."""
        events = self._text(self._utf8.decode(b"", final=True), final=True)
        self._pending, self._data, self._kind = "", [], ""
        return events

    def _text(self, text: str, *, final: bool) -> list[SseEvent]:
        buffer = self._pending + text
        if not self._started and buffer:
            self._started = True
            buffer = buffer.removeprefix(_BOM)
        events: list[SseEvent] = []
        position = 0
        for end in _EOL.finditer(buffer):
            if end.group() == "\r" and end.end() == len(buffer) and not final:
                break  # a CR last in the chunk: the LF of the same line ending may be the next chunk's first byte
            event = self._line(buffer[position:end.start()])
            if event is not None:
                events.append(event)
            position = end.end()
        self._pending = buffer[position:]
        return events

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._kind = value
        elif name == "id":
            if "\0" not in value:
                self.last_event_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> SseEvent | None:
        data, kind = self._data, self._kind
        self._data, self._kind = [], ""
        if not data:
            return None
        return SseEvent(event=kind or "message", data="\n".join(data), id=self.last_event_id)


def decode_all(stream: bytes) -> list[SseEvent]:
    """Every event of a whole stream (for tests and small answers)."""
    decoder = SseDecoder()
    return [*decoder.feed(stream), *decoder.close()]
