"""The CLI's client of the gateway: `trainyard_sdk.Client`, with the CLI's way of failing and of following streams.

Every request, its body's validation, the parsing of answers into the gateway's models, server-sent events and
resuming a dropped stream are the SDK's (libs/trainyard_sdk); what is here is what the CLI decides differently:

- Failures: every `SdkError` is raised as a `CliError` (main prints `error: <message>`, exit 1; a configuration
  problem is a `UsageError`, exit 2) with the API's own message (`message_of`, pure): a 401 names where the
  token came from, a refused connection asks whether `make run` is running.
- No automatic retries (`retry=None`): a person at a terminal runs the command again.
- Streams (`follow_logs`, `watch_job`, `watch_jobs`): a stream whose first connection fails fails at once, as any
  request does; one that was connected and dropped is resumed from its last event id (`Last-Event-ID`) after
  0.25, 0.5, 1, 2, 4, then 5 s delays, telling `on_reconnect(reason)` before each, and given up after
  `RECONNECTS` attempts in a row with no event (about half a minute).
- JSON output is the gateway's answer: `dump(model)` is the model as the gateway serialises it (by alias:
  `from` in a usage report), and the tables read the same dicts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel

from trainyard_sdk import (
    Client,
    ConfigurationError,
    ConnectionFailed,
    EventStream,
    Reconnect,
    SdkError,
    Unauthenticated,
)
from trainyard_sdk.config import Target
from trainyard_sdk.connection import USER_AGENT, VERSION
from trainyard_sdk.wire import Request, Resume, StreamCall

from .errors import CliError, UsageError

T = TypeVar("T")
UA = f"trainyard-cli/{VERSION} {USER_AGENT}"
# Reconnects of a stream in a row without an event before giving up: 0.25 + 0.5 + 1 + 2 + 4 + 4 x 5 s ≈ 28 s.
RECONNECTS = 9
RECONNECT = Reconnect(max_failures=RECONNECTS, backoff_s=0.25, max_delay_s=5.0)
# The gateway sends a keepalive comment every 15 s: a stream silent for longer than this lost its connection.
STREAM_IDLE_S = 45.0


def dump(model: BaseModel) -> dict[str, Any]:
    """The JSON object of a result, as the gateway wrote it."""
    return model.model_dump(mode="json", by_alias=True)


def message_of(error: SdkError, target: Target) -> str:
    """The CLI's one-line message for a failure. Pure."""
    if isinstance(error, Unauthenticated):
        return f"{error.message} (token from {target.token_source or 'nowhere'})"
    if isinstance(error, ConnectionFailed) and error.refused:
        return f"cannot reach the gateway at {target.url}: connection refused — is `make run` running?"
    return error.message


class Api(Client):
    """`trainyard_sdk.Client` raising CliErrors. `on_reconnect(reason)` is told before each reconnect of a
    stream."""

    def __init__(self, target: Target, *, timeout: float = 30.0, transport: Any = None,
                 on_reconnect: Callable[[str], None] | None = None) -> None:
        self.on_reconnect = on_reconnect
        try:
            super().__init__(target, timeout_s=timeout, stream_idle_s=max(timeout, STREAM_IDLE_S), retry=None,
                             reconnect=RECONNECT, user_agent=UA, transport=transport)
        except ConfigurationError as exc:  # a CA bundle that cannot be read
            raise UsageError(exc.message) from None

    def __enter__(self) -> Api:
        return self

    def failed(self, error: SdkError) -> BaseException:
        if isinstance(error, ConfigurationError):
            return UsageError(error.message)
        return CliError(message_of(error, self.target))

    def _stream(self, call: StreamCall[T]) -> EventStream[T]:
        follow = _Following(self)
        stream = EventStream(call, follow.connect, url=self.url, reconnect=self.options.reconnect,
                             sleep=follow.before_reconnect, failed=follow.failed)
        follow.resume = stream.resume
        return stream

    def open_stream(self, request: Request) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        """One connection of a stream (the SDK's)."""
        return self._connect(request)


class _Following:
    """One stream's connections as the CLI follows them. The SDK's loop decides when to reconnect and after how
    long (`Resume`); this fails a stream whose first connection failed at once, tells of each reconnect, and
    says why it gave up."""

    def __init__(self, api: Api) -> None:
        self._api = api
        self.resume: Resume | None = None
        self.connected = False
        self.error: SdkError | None = None  # why the last connection ended, when it failed

    @contextlib.contextmanager
    def connect(self, request: Request) -> Iterator[Iterator[bytes]]:
        self.error = None
        try:
            with self._api.open_stream(request) as chunks:
                self.connected = True
                yield chunks
        except SdkError as error:
            self.error = error
            raise

    def before_reconnect(self, delay: float) -> None:
        url = self._api.url
        # No error seen: the answer ended without the stream's end event (the SDK's own ConnectionFailed).
        error = self.error or ConnectionFailed(f"the gateway at {url} ended the stream before its end", url=url)
        if not self.connected:
            raise self._api.failed(error) from error  # the first connection failed: as for any request
        if self._api.on_reconnect is not None:
            self._api.on_reconnect(error.message)
        time.sleep(delay)

    def failed(self, error: SdkError) -> NoReturn:
        reconnects = self.resume.failures - 1 if self.resume is not None else 0
        if self.connected and reconnects > 0 and isinstance(error, ConnectionFailed):
            raise CliError(f"lost the stream from the gateway at {self._api.url} ({error.message}); gave up after "
                           f"{reconnects} reconnects") from error
        raise self._api.failed(error) from error
