"""Every error family as a real gateway answers it, raised by both clients as its exception with the API's code,
message and request id; the automatic retries of 429 and 503 (reads, and writes with an Idempotency-Key only);
and the failures without an answer (refused, timed out, not the API)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway, running_gateway
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually
from trainyard_gateway.tokens import new_secret
from trainyard_sdk import (
    AsyncClient,
    Client,
    ConnectionFailed,
    FailedPrecondition,
    InvalidArgument,
    InvalidPageToken,
    NotFound,
    PermissionDenied,
    ProtocolError,
    RateLimited,
    Reconnect,
    Retry,
    SdkError,
    Unauthenticated,
    Unavailable,
)

from .support import Sdk, Sent

SPEC: dict[str, Any] = {"name": "x", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}


async def test_each_family_from_the_real_gateway(sdk: Sdk, live_gateway: RunningGateway, scheduler: Cluster) -> None:
    alice = await live_gateway.create_token("vision", "alice")
    viewer = await live_gateway.create_token("vision", "vic", role="viewer")
    api, as_viewer = sdk(live_gateway.url, alice), sdk(live_gateway.url, viewer)

    with pytest.raises(Unauthenticated) as unauthenticated:
        await sdk(live_gateway.url, new_secret())(lambda c: c.list_queues())
    assert (unauthenticated.value.status, unauthenticated.value.code) == (401, "unauthenticated")
    with pytest.raises(Unauthenticated):
        await sdk(live_gateway.url)(lambda c: c.list_queues())  # no token at all

    with pytest.raises(PermissionDenied) as denied:
        await as_viewer(lambda c: c.submit_job(SPEC))
    assert (denied.value.status, denied.value.code) == (403, "permission_denied")
    with pytest.raises(PermissionDenied):
        await api(lambda c: c.audit_page())  # operators only

    with pytest.raises(NotFound) as missing:
        await api(lambda c: c.get_job("job-00000000000000000000"))
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    assert "job-00000000000000000000" in missing.value.message

    with pytest.raises(FailedPrecondition) as conflict:
        await sdk(live_gateway.url, live_gateway.admin_token)(lambda c: c.delete_queue("default"))
    assert (conflict.value.status, conflict.value.code) == (409, "failed_precondition")

    with pytest.raises(InvalidArgument) as invalid:  # the query is the server's to check
        await api(lambda c: c.list_jobs_page(page_size=100_000))
    assert (invalid.value.status, invalid.value.code) == (400, "invalid_argument")
    assert "query parameter page_size" in invalid.value.message

    await api(lambda c: c.submit_job(SPEC))
    await api(lambda c: c.submit_job(SPEC))
    page = await api(lambda c: c.list_jobs_page(page_size=1, state="pending"))
    with pytest.raises(InvalidPageToken) as bad_token:  # a token of other filters
        await api(lambda c: c.list_jobs_page(page_size=1, page_token=page.next_page_token, state="failed"))
    assert (bad_token.value.status, bad_token.value.code) == (422, "invalid_page_token")


async def test_the_request_id_of_an_error_is_the_one_the_gateway_audited(sdk: Sdk, live_gateway: RunningGateway,
                                                                        scheduler: Cluster) -> None:
    viewer = await live_gateway.create_token("vision", "vic", role="viewer")
    sent: list[Sent] = []
    api = sdk(live_gateway.url, viewer, transport=sdk.recording(sent))
    with pytest.raises(PermissionDenied) as denied:
        await api(lambda c: c.submit_job(SPEC))
    assert denied.value.request_id == sent[-1].request_id and denied.value.request_id.startswith("sdk-")
    admin = sdk(live_gateway.url, live_gateway.admin_token)

    async def audited() -> list[Any]:
        entries: list[Any] = await admin(lambda c: c.audit(request_id=denied.value.request_id))
        return entries

    (entry,) = await eventually(audited, what="the refused submit's audit entry")
    assert (entry.result, entry.principal) == ("permission_denied", "user:vision/vic")


async def test_429_carries_retry_after_and_is_not_waited_for_when_long(sdk: Sdk, etcd_settings: dict[str, str],
                                                                       key_prefix: str) -> None:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}", rate_limit_per_s=0.01,
                               rate_limit_burst=3) as gw:
        alice = await gw.create_token("vision", "alice")
        for _ in range(3):  # the burst, spent (no scheduler behind this gateway: 503s)
            with pytest.raises(Unavailable):
                await sdk(gw.url, alice, retry=None)(lambda c: c.list_queues())
        sent: list[Sent] = []
        api = sdk(gw.url, alice, transport=sdk.recording(sent), retry=Retry(max_attempts=3, max_delay_s=5))
        with pytest.raises(RateLimited) as limited:
            await api(lambda c: c.list_queues())
    assert (limited.value.status, limited.value.code) == (429, "resource_exhausted")
    assert limited.value.retry_after is not None and limited.value.retry_after > 5
    assert "rate limit of alice's token exceeded" in limited.value.message
    assert len(sent) == 1  # Retry-After (about 100 s) is past max_delay_s: raised at once


async def test_a_short_429_is_waited_for_and_sent_again(sdk: Sdk, etcd_settings: dict[str, str],
                                                        key_prefix: str) -> None:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}", rate_limit_per_s=1,
                               rate_limit_burst=1) as gw:
        alice = await gw.create_token("vision", "alice")
        with pytest.raises(Unavailable):  # spends the burst of one
            await sdk(gw.url, alice, retry=None)(lambda c: c.list_queues())
        sent: list[Sent] = []
        api = sdk(gw.url, alice, transport=sdk.recording(sent), retry=Retry(max_attempts=2, max_delay_s=5))
        with pytest.raises(Unavailable):  # the second attempt, after the 429's Retry-After, got through to the 503
            await api(lambda c: c.list_queues())
    assert len(sent) == 2 and sent[0].request_id == sent[1].request_id


async def test_503_is_retried_for_reads_and_keyed_writes_only(sdk: Sdk, gateway: RunningGateway) -> None:
    sent: list[Sent] = []
    api = sdk(gateway.url, gateway.admin_token, transport=sdk.recording(sent),
              retry=Retry(max_attempts=2, max_delay_s=5))
    with pytest.raises(Unavailable) as unavailable:  # no scheduler behind this gateway
        await api(lambda c: c.list_queues())
    assert (unavailable.value.status, unavailable.value.code, unavailable.value.retry_after) == (503, "unavailable", 1)
    assert [(s.method, s.path) for s in sent] == [("GET", "/v1/queues")] * 2  # retried once, after Retry-After: 1
    assert sent[0].request_id == sent[1].request_id

    sent.clear()
    with pytest.raises(Unavailable):
        await api(lambda c: c.submit_job(SPEC))
    assert [s.method for s in sent] == ["POST"]  # a write without an Idempotency-Key: sent once
    sent.clear()
    with pytest.raises(Unavailable):
        await api(lambda c: c.submit_job(SPEC, idempotency_key="run-1"))
    assert [(s.method, s.idempotency_key) for s in sent] == [("POST", "run-1")] * 2

    sent.clear()
    with pytest.raises(Unavailable):
        await sdk(gateway.url, gateway.admin_token, transport=sdk.recording(sent), retry=None)(
            lambda c: c.list_queues())
    assert len(sent) == 1


@contextlib.asynccontextmanager
async def tcp_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                     ) -> AsyncIterator[str]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_failures_without_an_answer(sdk: Sdk) -> None:
    port = free_port()
    with pytest.raises(ConnectionFailed) as refused:
        await sdk(f"http://127.0.0.1:{port}", "t", retry=None)(lambda c: c.get_job("job-1"))
    assert refused.value.refused and not refused.value.timed_out
    assert refused.value.message == f"cannot reach the gateway at http://127.0.0.1:{port}: connection refused"

    stop = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stop.wait()  # reads nothing, answers nothing
        writer.close()

    async with tcp_server(silent) as url:
        with pytest.raises(ConnectionFailed) as slow:
            await sdk(url, "t", timeout_s=0.3)(lambda c: c.get_job("job-1"))
        stop.set()
    assert slow.value.timed_out and not slow.value.refused
    assert "did not answer within 0.3s" in slow.value.message

    async def not_the_api(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b"<html>a captive portal</html>"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async with tcp_server(not_the_api) as url:
        with pytest.raises(ProtocolError, match="the gateway's answer is not a Job"):
            await sdk(url, "t")(lambda c: c.get_job("job-1"))
        with pytest.raises(ProtocolError, match="not an event stream"):
            await sdk(url, "t")(lambda c: c.watch_job("job-1"))


class Refused(Exception):
    """What a tool of its own raises (the CLI: its CliError)."""


class SyncAdapter(Client):
    def failed(self, error: SdkError) -> BaseException:
        return Refused(f"error: {error.message}")


class AsyncAdapter(AsyncClient):
    def failed(self, error: SdkError) -> BaseException:
        return Refused(f"error: {error.message}")


async def test_a_subclass_raises_its_own_errors_for_calls_listings_and_streams(sdk: Sdk,
                                                                               gateway: RunningGateway) -> None:
    api = sdk(gateway.url, gateway.admin_token, sync_cls=SyncAdapter, async_cls=AsyncAdapter, retry=None,
              reconnect=Reconnect(max_failures=0))
    for op in (lambda c: c.list_queues(), lambda c: c.list_jobs(), lambda c: c.follow_logs("job-1")):
        with pytest.raises(Refused, match=r"^error: ") as info:
            await api(op)
        assert isinstance(info.value.__cause__, Unavailable)  # no scheduler behind this gateway
    with pytest.raises(Refused, match="path parameter job_id: required"):  # refused before sending, too
        await api(lambda c: c.get_job(""))
