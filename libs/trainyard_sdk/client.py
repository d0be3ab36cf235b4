"""`Client`: the synchronous client, over one `httpx.Client` (a connection pool; thread-safe, as httpx's is).

Its methods are the API's (methods.py, one table for both clients); what is here is the I/O: send a request
(retrying it as `wire.Retry` decides), follow a listing's pages, open a stream. `AsyncClient` (aio.py) is the
same over `httpx.AsyncClient`.

    with Client.from_env() as trainyard:
        job = trainyard.submit_job({"name": "smoke", "command": ["python", "train.py"],
                                    "resources": {"nodes": 1, "gpus_per_node": 8}})
        for line in trainyard.follow_logs(job.id):
            print(line.rank, line.text)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TypeVar

import httpx

from .binding import SyncRunner
from .connection import Configured, Transport, answer, failure, send_kwargs
from .errors import ProtocolError, SdkError, error_for
from .methods import Operations
from .streaming import EventStream
from .wire import Answer, Call, Paging, Request, StreamCall, check, new_request_id

T = TypeVar("T")
EVENT_STREAM = "text/event-stream"


class Client(Configured, Operations, SyncRunner):
    """The Trainyard gateway's API, synchronously. Close it (or use it as a context manager) to close its
    connections."""

    _http: httpx.Client

    def _open(self, transport: Transport | None) -> None:
        if transport is not None and not isinstance(transport, httpx.BaseTransport):
            raise TypeError("Client takes a synchronous httpx transport (httpx.BaseTransport)")
        self._http = httpx.Client(**self.options.httpx_kwargs(), transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _send(self, request: Request, request_id: str) -> Answer:
        try:
            return self._observe(answer(self._http.request(**send_kwargs(self._prepare(request), request_id))))
        except httpx.HTTPError as exc:
            raise failure(exc, self.url, self.options.timeout_s) from exc

    def _run(self, call: Call[T]) -> T:
        request_id = new_request_id()  # one per call: its retries are the same request to the gateway's audit
        attempt = 0
        while True:
            attempt += 1
            try:
                return check(call, self._send(call.request, request_id), request_id=request_id, now=time.time())
            except SdkError as error:
                delay = self.options.retry.delay(call.request, attempt, error)
                if delay is None:
                    self._raise(error)
            time.sleep(delay)

    def _pages(self, paging: Paging[T]) -> Iterator[T]:
        token = ""
        while True:
            page = self._run(paging.page(token))
            yield from paging.items(page)
            token, previous = paging.next_token(page), token
            if not token:
                return
            if token == previous:
                self._raise(ProtocolError(f"the gateway answered the page token {token!r} with itself as the next "
                                          "one"))

    def _stream(self, call: StreamCall[T]) -> EventStream[T]:
        return EventStream(call, self._connect, url=self.url, reconnect=self.options.reconnect, failed=self._raise,
                           on_reconnect=self.options.on_reconnect,
                           sleep=time.sleep)

    @contextlib.contextmanager
    def _connect(self, request: Request) -> Iterator[Iterator[bytes]]:
        request_id = new_request_id()
        kwargs = send_kwargs(request.with_header("Accept", EVENT_STREAM), request_id)
        try:
            with self._http.stream(**kwargs, timeout=self.options.stream_timeout()) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_for(response.status_code, response.reason_phrase,
                                    {k.lower(): v for k, v in response.headers.items()}, response.content,
                                    sent_request_id=request_id, now=time.time())
                if not response.headers.get("content-type", "").startswith(EVENT_STREAM):
                    raise ProtocolError(f"{request.path} answered {response.headers.get('content-type')!r}, not "
                                        "an event stream")
                yield response.iter_bytes()
        except httpx.HTTPError as exc:
            raise failure(exc, self.url, self.options.stream_idle_s) from exc
