"""The httpx side that both clients share: options from the configuration, a `Request` as httpx arguments, an
httpx response as an `Answer`, and an httpx failure as a `ConnectionFailed` that says plainly what happened.
The clients do only the sending (`httpx.Client` and `httpx.AsyncClient`)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn, Self

import httpx

from .config import Target, check_url, resolve, ssl_context
from .errors import ConnectionFailed, SdkError
from .streaming import OnReconnect
from .wire import NO_RETRY, REQUEST_ID_HEADER, Answer, Reconnect, Request, Retry, lower_headers, reads_at, revision_of

try:
    VERSION = metadata.version("trainyard")
except metadata.PackageNotFoundError:  # a source tree without the package installed
    VERSION = "0.0.0"
USER_AGENT = f"trainyard-sdk/{VERSION} httpx/{httpx.__version__}"
DEFAULT_TIMEOUT_S = 30.0
# A stream is idle at most this long: the gateway sends a keepalive comment every 15 s, so a silent connection
# past this is dead (a host gone without a FIN) and is reconnected.
DEFAULT_STREAM_IDLE_S = 45.0
DEFAULT_RETRY = Retry()
DEFAULT_RECONNECT = Reconnect()


@dataclass(frozen=True, slots=True)
class Options:
    """A client's configuration, built once by its constructor."""

    target: Target
    verify: bool | ssl.SSLContext = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S
    retry: Retry = field(default_factory=Retry)
    reconnect: Reconnect = field(default_factory=Reconnect)
    user_agent: str = USER_AGENT
    on_reconnect: OnReconnect | None = None

    def httpx_kwargs(self) -> dict[str, Any]:
        headers = {"User-Agent": self.user_agent, "Accept": "application/json"}
        if self.target.token:
            headers["Authorization"] = f"Bearer {self.target.token}"
        return {"base_url": self.target.url, "headers": headers, "timeout": self.timeout_s,
                "verify": ssl_context(verify=self.verify, ca_bundle=self.target.ca_bundle)}

    def stream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout_s, read=self.stream_idle_s)


def send_kwargs(request: Request, request_id: str) -> dict[str, Any]:
    """httpx's `request()`/`stream()` arguments for `request`, tagged with `request_id`."""
    kwargs: dict[str, Any] = {"method": request.method, "url": request.path,
                              "headers": {**dict(request.headers), REQUEST_ID_HEADER: request_id}}
    if request.params:
        kwargs["params"] = list(request.params)
    if request.body is not None:
        kwargs["json"] = request.body
    return kwargs


def answer(response: httpx.Response) -> Answer:
    """The answer, once its body was read."""
    return Answer(status=response.status_code, reason=response.reason_phrase, headers=lower_headers(
        dict(response.headers)), body=response.content)


def _refused(exc: BaseException) -> bool:
    """Whether the connection was refused, somewhere in the chain of causes (the async transport reports "All
    connection attempts failed" caused by the ConnectionRefusedError)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _reason(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    low = text.lower()
    if _refused(exc):
        return "connection refused"
    if "name or service not known" in low or "nodename nor servname" in low or "name resolution" in low:
        return "unknown host"
    if "certificate verify failed" in low:
        return f"TLS: the gateway's certificate is not trusted ({text}); pass ca_bundle= or set TRAINYARD_CA_BUNDLE"
    return text


def failure(exc: httpx.HTTPError, url: str, timeout_s: float) -> ConnectionFailed:
    """What a transport error means to the caller. `refused`: the connection was never made, so nothing was
    sent (safe to retry any request)."""
    if isinstance(exc, httpx.TimeoutException):
        return ConnectionFailed(f"the gateway at {url} did not answer within {timeout_s:g}s", url=url,
                                timed_out=True, refused=isinstance(exc, httpx.ConnectTimeout))
    if isinstance(exc, httpx.ConnectError):
        return ConnectionFailed(f"cannot reach the gateway at {url}: {_reason(exc)}", url=url, refused=_refused(exc))
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
        return ConnectionFailed(f"the connection to the gateway at {url} was lost: {_reason(exc)}", url=url)
    return ConnectionFailed(f"request to the gateway at {url} failed: {_reason(exc)}", url=url)


Transport = httpx.BaseTransport | httpx.AsyncBaseTransport


class Configured:
    """The configuration both clients take: `Client(url, token)`, `Client(target)` or `Client.from_env()` (the
    CLI's rules: config.py).

    - `ca_bundle`: PEM file of the CA of an HTTPS gateway; `verify=False` turns verification off (never in
      production), or pass an `ssl.SSLContext`.
    - `timeout_s`: for each request (connect, read, write); `stream_idle_s`: the longest silence on a stream
      before it is taken for dead and reconnected.
    - `retry`: automatic retries of reads and of writes with an Idempotency-Key (`wire.Retry`); None: none.
    - `reconnect`: how streams reconnect (`wire.Reconnect`).
    - `on_reconnect(error, delay_s)`: told before a stream reconnects, with why its connection ended and how
      long it waits first (a progress line, a metric); it returns nothing and should not block.
    - `transport`: an httpx transport of the client's kind (sync or async), e.g. a proxy's or a test's.
    """

    def __init__(self, url: str | Target, token: str = "", *, ca_bundle: str = "",
                 verify: bool | ssl.SSLContext = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 stream_idle_s: float = DEFAULT_STREAM_IDLE_S, retry: Retry | None = DEFAULT_RETRY,
                 reconnect: Reconnect = DEFAULT_RECONNECT, user_agent: str = USER_AGENT,
                 transport: Transport | None = None, on_reconnect: OnReconnect | None = None) -> None:
        if isinstance(url, Target):
            target = replace(url, url=check_url(url.url, url.url_source), token=token or url.token,
                             ca_bundle=ca_bundle or url.ca_bundle)
        else:
            target = Target(url=check_url(url), token=token, ca_bundle=ca_bundle)
        self.options = Options(target=target, verify=verify, timeout_s=timeout_s, stream_idle_s=stream_idle_s,
                               retry=retry or NO_RETRY, reconnect=reconnect, user_agent=user_agent,
                               on_reconnect=on_reconnect)
        self.revision = 0  # the highest X-Trainyard-Revision answered so far (wire.reads_at)
        self._open(transport)

    def _open(self, transport: Transport | None) -> None:
        raise NotImplementedError

    @classmethod
    def from_env(cls, *, url: str | None = None, token: str | None = None, ca_bundle: str | None = None,
                 environ: Mapping[str, str] | None = None, cwd: Path | None = None, need_token: bool = True,
                 **options: Any) -> Self:
        """A client of the gateway named by `url` or TRAINYARD_URL, with `token` or TRAINYARD_TOKEN, each from the
        argument, the environment or `.trainyard/local.env` (config.py); `options` as for the constructor."""
        target = resolve(url=url, token=token, ca_bundle=ca_bundle, environ=os.environ if environ is None
                         else environ, cwd=Path.cwd() if cwd is None else cwd, need_token=need_token)
        return cls(target, **options)

    def failed(self, error: SdkError) -> BaseException:
        """What a failed call raises, given the SdkError it failed with: the error itself. A subclass may turn it
        into its own (the CLI's adapter raises its CliError with the message); the SdkError is its cause."""
        return error

    def _raise(self, error: SdkError) -> NoReturn:
        translated = self.failed(error)
        if translated is error:
            raise error
        raise translated from error

    def _prepare(self, request: Request) -> Request:
        return reads_at(request, self.revision)

    def _observe(self, got: Answer) -> Answer:
        self.revision = max(self.revision, revision_of(got))
        return got

    @property
    def url(self) -> str:
        return self.options.target.url

    @property
    def target(self) -> Target:
        """The gateway, the token and where each was found (`token_source`, for a 401's message)."""
        return self.options.target
