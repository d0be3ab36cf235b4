"""`AsyncClient`: the asynchronous client, over one `httpx.AsyncClient`. The I/O of `Client` (client.py), with
await: its methods (methods.py) are the same, each a coroutine; listings and streams are async iterators.

    async with AsyncClient.from_env() as trainyard:
        job = await trainyard.submit_job({"name": "smoke", "command": ["python", "train.py"],
                                          "resources": {"nodes": 1, "gpus_per_node": 8}})
        async for line in trainyard.follow_logs(job.id):
            print(line.rank, line.text)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TypeVar

import httpx

from .binding import AsyncRunner
from .connection import Configured, Transport, answer, failure, send_kwargs
from .errors import ProtocolError, SdkError, error_for
from .methods import Operations
from .streaming import AsyncEventStream
from .wire import Answer, Call, Paging, Request, StreamCall, check, new_request_id

T = TypeVar("T")
EVENT_STREAM = "text/event-stream"


class AsyncClient(Configured, Operations, AsyncRunner):
    """The Trainyard gateway's API, for asyncio. Close it (`await aclose()`, or `async with`) to close its
    connections."""

    _http: httpx.AsyncClient

    def _open(self, transport: Transport | None) -> None:
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise TypeError("AsyncClient takes an asynchronous httpx transport (httpx.AsyncBaseTransport)")
        self._http = httpx.AsyncClient(**self.options.httpx_kwargs(), transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def _send(self, request: Request, request_id: str) -> Answer:
        try:
            return self._observe(answer(await self._http.request(**send_kwargs(self._prepare(request), request_id))))
        except httpx.HTTPError as exc:
            raise failure(exc, self.url, self.options.timeout_s) from exc

    async def _run(self, call: Call[T]) -> T:
        request_id = new_request_id()  # one per call: its retries are the same request to the gateway's audit
        attempt = 0
        while True:
            attempt += 1
            try:
                return check(call, await self._send(call.request, request_id), request_id=request_id,
                             now=time.time())
            except SdkError as error:
                delay = self.options.retry.delay(call.request, attempt, error)
                if delay is None:
                    self._raise(error)
            await asyncio.sleep(delay)

    async def _pages(self, paging: Paging[T]) -> AsyncIterator[T]:
        token = ""
        while True:
            page = await self._run(paging.page(token))
            for item in paging.items(page):
                yield item
            token, previous = paging.next_token(page), token
            if not token:
                return
            if token == previous:
                self._raise(ProtocolError(f"the gateway answered the page token {token!r} with itself as the next "
                                          "one"))

    def _stream(self, call: StreamCall[T]) -> AsyncEventStream[T]:
        return AsyncEventStream(call, self._connect, url=self.url, reconnect=self.options.reconnect, failed=self._raise,
                           on_reconnect=self.options.on_reconnect,
                                sleep=asyncio.sleep)

    @contextlib.asynccontextmanager
    async def _connect(self, request: Request) -> AsyncIterator[AsyncIterator[bytes]]:
        request_id = new_request_id()
        kwargs = send_kwargs(request.with_header("Accept", EVENT_STREAM), request_id)
        try:
            async with self._http.stream(**kwargs, timeout=self.options.stream_timeout()) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise error_for(response.status_code, response.reason_phrase,
                                    {k.lower(): v for k, v in response.headers.items()}, response.content,
                                    sent_request_id=request_id, now=time.time())
                if not response.headers.get("content-type", "").startswith(EVENT_STREAM):
                    raise ProtocolError(f"{request.path} answered {response.headers.get('content-type')!r}, not "
                                        "an event stream")
                yield response.aiter_bytes()
        except httpx.HTTPError as exc:
            raise failure(exc, self.url, self.options.stream_idle_s) from exc
