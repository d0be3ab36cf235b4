"""How the SDK's tests drive either client from the test's event loop (where the gateway runs): `Sdk` makes
clients of one flavour, `Api` runs one call on one of them to its result, the same line for both flavours."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from trainyard_sdk import AsyncClient, Client

AnyClient = Client | AsyncClient


def _materialise(result: Any) -> Any:
    if isinstance(result, Iterator):
        with_close = getattr(result, "close", None)
        try:
            return list(result)
        finally:
            if with_close is not None:
                with_close()
    return result


class Api:
    """One client of the test's flavour; calling it runs `op(client)` to its result."""

    def __init__(self, client: AnyClient) -> None:
        self.client = client

    @property
    def is_async(self) -> bool:
        return isinstance(self.client, AsyncClient)

    async def __call__(self, op: Callable[[Any], Any]) -> Any:
        if isinstance(self.client, Client):
            client = self.client
            return await asyncio.to_thread(lambda: _materialise(op(client)))
        result = op(self.client)
        if inspect.isawaitable(result):
            return await result
        if hasattr(result, "__aiter__"):
            items = [item async for item in result]
            closer = getattr(result, "aclose", None)
            if closer is not None:
                await closer()
            return items
        return result


class Sdk:
    """Makes clients of one flavour (`"sync"` or `"async"`) and closes them at the end of the test."""

    def __init__(self, flavour: str) -> None:
        self.flavour = flavour
        self._made: list[AnyClient] = []

    def recording(self, sent: list[Sent]) -> httpx.BaseTransport | httpx.AsyncBaseTransport:
        return recording_transport(self.flavour, sent)

    def __call__(self, url: str, token: str = "", *, sync_cls: type[Client] = Client,
                 async_cls: type[AsyncClient] = AsyncClient, **options: Any) -> Api:
        client: AnyClient = sync_cls(url, token, **options) if self.flavour == "sync" else \
            async_cls(url, token, **options)
        self._made.append(client)
        return Api(client)

    def from_env(self, **kwargs: Any) -> Api:
        """A client of the flavour made by `from_env(**kwargs)`."""
        cls = Client if self.flavour == "sync" else AsyncClient
        client: AnyClient = cls.from_env(**kwargs)
        self._made.append(client)
        return Api(client)

    async def close(self) -> None:
        for client in self._made:
            if isinstance(client, AsyncClient):
                await client.aclose()
            else:
                client.close()


@dataclass(frozen=True)
class Sent:
    method: str
    path: str
    request_id: str
    idempotency_key: str


class _SyncRecorder(httpx.HTTPTransport):
    def __init__(self, sent: list[Sent]) -> None:
        super().__init__()
        self._sent = sent

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self._sent.append(_sent(request))
        return super().handle_request(request)


class _AsyncRecorder(httpx.AsyncHTTPTransport):
    def __init__(self, sent: list[Sent]) -> None:
        super().__init__()
        self._sent = sent

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._sent.append(_sent(request))
        return await super().handle_async_request(request)


def _sent(request: httpx.Request) -> Sent:
    return Sent(request.method, request.url.path, request.headers.get("x-request-id", ""),
                request.headers.get("idempotency-key", ""))


def recording_transport(flavour: str, sent: list[Sent]) -> httpx.BaseTransport | httpx.AsyncBaseTransport:
    """httpx's own transport for the flavour's client, noting each request it sends (a retry is a second one)."""
    return _SyncRecorder(sent) if flavour == "sync" else _AsyncRecorder(sent)
