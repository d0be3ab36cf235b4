"""The SDK's server-sent events decoder: the WHATWG rules case by case, the gateway's own encoder read back, and
the property a network imposes: any chunking of a stream (inside a UTF-8 sequence, between the CR and LF of one
line ending) decodes to the same events as the whole stream."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_gateway.sse import KEEPALIVE, Event, encode
from trainyard_sdk.sse import SseDecoder, SseEvent, decode_all


@pytest.mark.parametrize(("stream", "events"), [
    # one event, the gateway's shape
    (b"id: 7\nevent: line\ndata: {\"a\":1}\n\n", [SseEvent("line", '{"a":1}', "7")]),
    # data lines join with newlines; no kind is "message"
    (b"data: one\ndata: two\n\n", [SseEvent("message", "one\ntwo")]),
    # only one space after the colon is dropped; none is fine too
    (b"data:x\ndata:  y\n\n", [SseEvent("message", "x\n y")]),
    # a field without a colon has an empty value: "data" alone is an empty data line
    (b"data\n\n", [SseEvent("message", "")]),
    # comments (the gateway's keepalive) change nothing
    (b": keepalive\n\n: hi\ndata: z\n\n", [SseEvent("message", "z")]),
    # the last event id stays until another one is set, and an empty id clears it
    (b"id: a\ndata: 1\n\ndata: 2\n\nid\ndata: 3\n\n",
     [SseEvent("message", "1", "a"), SseEvent("message", "2", "a"), SseEvent("message", "3", "")]),
    # an id with NUL is ignored
    (b"id: a\ndata: 1\n\nid: b\x00c\ndata: 2\n\n", [SseEvent("message", "1", "a"), SseEvent("message", "2", "a")]),
    # an event without data is not dispatched, but its id counts; its kind does not carry over
    (b"id: 5\nevent: ping\n\ndata: d\n\n", [SseEvent("message", "d", "5")]),
    # CRLF, CR and LF line endings, mixed
    (b"data: a\r\ndata: b\rdata: c\n\r\n", [SseEvent("message", "a\nb\nc")]),
    # a byte order mark first is dropped, only there
    (b"\xef\xbb\xbfdata: bom\n\n", [SseEvent("message", "bom")]),
    # unknown fields are ignored
    (b"foo: bar\ndata: q\n\n", [SseEvent("message", "q")]),
    # what is left without its blank line at the end is dropped
    (b"data: whole\n\ndata: cut sh", [SseEvent("message", "whole")]),
])
def test_the_rules(stream: bytes, events: list[SseEvent]) -> None:
    assert decode_all(stream) == events


def test_retry_sets_the_reconnection_delay_and_only_digits_count() -> None:
    decoder = SseDecoder()
    decoder.feed(b"retry: 2500\n\n")
    assert decoder.retry_ms == 2500
    decoder.feed(b"retry: 1.5\nretry: -3\nretry: \xd9\xa3\n\n")  # not ASCII digits: ignored
    assert decoder.retry_ms == 2500


def test_a_lone_cr_at_the_end_of_a_chunk_waits_for_the_next_one() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n\r") == []  # CRLF ended the data line; this CR may be the blank line's CR of a CRLF
    assert decoder.feed(b"\n") == [SseEvent("message", "a")]
    assert decoder.feed(b"data: b\r\r") == []  # the second CR, last again, may still be a CRLF's
    assert decoder.feed(b"data: c") == [SseEvent("message", "b")]  # it was not: a blank line


def test_the_stream_closing_reads_a_last_line_ended_by_cr() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\n\r") == []
    assert decoder.close() == [SseEvent("message", "a")]


def test_a_resumed_decoder_starts_from_the_last_event_id_it_is_given() -> None:
    decoder = SseDecoder(last_event_id="p-41")
    assert decoder.feed(b"data: x\n\n") == [SseEvent("message", "x", "p-41")]


def test_the_gateways_encoder_reads_back() -> None:
    sent = [Event("line", {"rank": 0, "text": "a: b\nc \u00e9\u6f22"}, id="r0=5"), Event("end", {"state": "succeeded"})]
    wire = KEEPALIVE.join(encode(e) for e in sent)
    got = decode_all(wire)
    assert [(e.event, e.id) for e in got] == [("line", "r0=5"), ("end", "r0=5")]
    assert got[0].data == '{"rank":0,"text":"a: b\\nc \u00e9\u6f22"}'


# --- any chunking, the same events ----------------------------------------------------------------------

@dataclass(frozen=True)
class Sent:
    id: str | None
    kind: str
    data: list[str]
    comments: list[str]


_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n\x00"), max_size=12)
_sent = st.builds(Sent, id=st.none() | _text, kind=_text, data=st.lists(_text, min_size=1, max_size=3),
                  comments=st.lists(_text, max_size=2))
_ending = st.sampled_from(["\n", "\r\n", "\r"])


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[SseEvent]]:
    """A stream of events, comments among them, and the events it holds. One line ending per stream, as a server
    writes it: a CR ending followed by an empty line's LF would be one CRLF (the spec's rule, not a decoder's)."""
    sent = draw(st.lists(_sent, max_size=6))
    bom = draw(st.booleans())
    lines: list[str] = []
    expected: list[SseEvent] = []
    last_id = ""
    for s in sent:
        lines += [":" + c for c in s.comments]
        if s.id is not None:
            lines.append("id: " + s.id)
            last_id = s.id
        if s.kind:
            lines.append("event: " + s.kind)
        lines += ["data: " + d for d in s.data]
        lines.append("")
        expected.append(SseEvent(s.kind or "message", "\n".join(s.data), last_id))
    ending = draw(_ending)
    text = "".join(line + ending for line in lines)
    return ("\ufeff" if bom else "").encode() + text.encode(), expected


@settings(max_examples=300, deadline=None)
@given(streams(), st.data())
def test_any_chunking_of_a_stream_gives_the_same_events(stream: tuple[bytes, list[SseEvent]], data: st.DataObject,
                                                        ) -> None:
    whole, expected = stream
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=12)))
    chunks = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    decoder = SseDecoder()
    got = [e for chunk in chunks for e in decoder.feed(chunk)] + decoder.close()
    assert got == expected
    assert decode_all(whole) == expected
