"""The gateway's HTTP metrics: the real `trainyard-gateway` process (mTLS, JSON logs) serving /metrics on its
metrics port, parsed with Prometheus' text parser after real requests; each request counted under its route
template (never its path), method and status; and the exposition built from the per-series counts."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from starlette.types import Message, Receive, Scope, Send

from tests.gateway.test_main import GATEWAY, _tls, _wait_for_file
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.etcd_secure import as_flags
from trainyard_core.testing.metrics import Scrape, scrape
from trainyard_core.testing.wait import eventually
from trainyard_gateway.http_errors import AccessLogAndCatchAll
from trainyard_gateway.http_metrics import BUCKETS, HttpMetrics, RequestDurations
from trainyard_gateway.tokens import new_secret

DURATION = "trainyard_gateway_http_request_duration_seconds"
IN_FLIGHT = "trainyard_gateway_http_requests_in_flight"


@dataclass
class Process:
    url: str
    token: str
    metrics_port: int


@pytest.fixture
def gateway_process(tmp_path: Path, etcd_settings: dict[str, str], key_prefix: str) -> Iterator[Process]:
    """The gateway as production runs it (no scheduler behind it: what needs one answers 503)."""
    secret = new_secret()
    ready = tmp_path / "ready.json"
    metrics_port = free_port()
    proc = subprocess.Popen(
        [GATEWAY, "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready), *as_flags(etcd_settings),
         "--etcd-prefix", key_prefix.rstrip("/"), "--scheduler-address", f"127.0.0.1:{free_port()}",
         "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port), *_tls(tmp_path)],
        env={**os.environ, "TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN": secret},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ports = _wait_for_file(ready, proc)
        yield Process(f"http://127.0.0.1:{ports['http_port']}", secret, metrics_port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _count(s: Scrape, **labels: str) -> float:
    return s.value(f"{DURATION}_count", **labels) or 0.0


async def test_requests_count_under_route_template_method_and_status(gateway_process: Process) -> None:
    gw = gateway_process

    async def serving() -> bool:
        try:
            await scrape("127.0.0.1", gw.metrics_port)
        except httpx.HTTPError:
            return False
        return True

    await eventually(serving, what="the gateway's /metrics")
    auth = {"Authorization": f"Bearer {gw.token}"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=30.0) as http:
        assert (await http.get("/v1/tokens", headers=auth)).status_code == 200
        assert (await http.get("/v1/tokens", headers=auth)).status_code == 200
        assert (await http.delete("/v1/tokens/t-not-a-token", headers=auth)).status_code == 404
        assert (await http.get("/v1/no-such-route", headers=auth)).status_code == 404
        assert (await http.get("/v1/jobs/j-metrics-probe", headers=auth)).status_code == 503  # no scheduler
        assert (await http.get("/v1/tokens")).status_code == 401
        assert (await http.request("PROPFIND", "/v1/tokens", headers=auth)).status_code == 405
        # A method outside the registered ones does not parse (uvicorn's httptools): the server answers 400
        # before the app sees it, so it is neither logged nor counted.
        unparsed = await http.request("BREW", "/v1/tokens", headers=auth)
        assert (unparsed.status_code, unparsed.text) == (400, "Invalid HTTP request received.")
    s = await scrape("127.0.0.1", gw.metrics_port)
    assert s.types[DURATION] == "histogram"
    assert s.types[IN_FLIGHT] == "gauge"
    assert _count(s, method="GET", route="/v1/tokens", status="200") == 2
    assert _count(s, method="DELETE", route="/v1/tokens/{token_id}", status="404") == 1
    assert _count(s, method="GET", route="unmatched", status="404") == 1
    assert _count(s, method="GET", route="/v1/jobs/{job_id}", status="503") == 1
    assert _count(s, method="GET", route="/v1/tokens", status="401") == 1
    assert _count(s, method="other", route="unmatched", status="405") == 1  # a method no route has
    # The buckets are cumulative and end with +Inf = count; the sum is the time spent.
    buckets = s.matching(f"{DURATION}_bucket", method="GET", route="/v1/tokens", status="200")
    assert [b.labels["le"] for b in buckets] == [*(repr(b) for b in BUCKETS), "+Inf"]
    assert [b.value for b in buckets] == sorted(b.value for b in buckets) and buckets[-1].value == 2
    assert (s.value(f"{DURATION}_sum", method="GET", route="/v1/tokens", status="200") or 0) > 0
    assert s.value(IN_FLIGHT) == 0
    # No path, id or method the caller made up is a label value.
    values = {v for sample in s.samples if sample.name.startswith("trainyard_gateway_") for v in sample.labels.values()}
    assert not {v for v in values if "t-not-a-token" in v or "j-metrics-probe" in v or "no-such-route" in v
                or v in ("BREW", "PROPFIND")}


def test_in_flight_counts_requests_until_they_are_answered() -> None:
    """The gauge reads the count the access log keeps (one `began`, then one `observe` per request)."""
    metrics = HttpMetrics(RequestDurations())
    start = REGISTRY.get_sample_value(IN_FLIGHT)
    assert start is not None
    metrics.began()
    metrics.began()
    assert REGISTRY.get_sample_value(IN_FLIGHT) == start + 2
    metrics.observe({"method": "GET"}, 200, 0.01)
    assert REGISTRY.get_sample_value(IN_FLIGHT) == start + 1
    metrics.observe({"method": "GET"}, 200, 0.01)
    assert REGISTRY.get_sample_value(IN_FLIGHT) == start


class _Route:
    """A route as Starlette leaves it in the scope: its template in `path`. Unhashable, as FastAPI's are."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, path: str) -> None:
        self.path = path


def test_durations_fall_in_their_buckets_and_label_sets_stay_bounded() -> None:
    durations = RequestDurations()
    registry = CollectorRegistry()
    registry.register(durations)
    metrics = HttpMetrics(durations)
    route = _Route("/v1/jobs/{job_id}")
    for seconds in (0.0005, 0.001, 0.003, 0.2, 100.0):
        metrics.began()
        metrics.observe({"route": route, "method": "GET"}, 200, seconds)
    for method in ("BREW", "PROPFIND", "get"):  # not methods the API has: one series for all of them
        metrics.began()
        metrics.observe({"method": method}, 404, 0.001)
    s = Scrape.parse(generate_latest(registry).decode())
    buckets = {b.labels["le"]: b.value for b in s.matching(f"{DURATION}_bucket", route="/v1/jobs/{job_id}")}
    assert buckets["0.001"] == 2 and buckets["0.005"] == 3 and buckets["0.25"] == 4 and buckets["60.0"] == 4
    assert buckets["+Inf"] == 5
    assert s.value(f"{DURATION}_sum", method="GET", route="/v1/jobs/{job_id}", status="200") == pytest.approx(
        100.2045)
    assert _count(s, method="other", route="unmatched", status="404") == 3
    assert {tuple(sorted(x.labels.items())) for x in s.matching(f"{DURATION}_count")} == {
        (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "200")),
        (("method", "other"), ("route", "unmatched"), ("status", "404"))}


async def test_a_crash_counts_as_500_and_a_caller_gone_before_the_answer_as_499() -> None:
    """Through the real access-log middleware (direct ASGI calls): the status counted is the one answered, and
    a request cancelled before any answer began is counted, not lost."""
    durations = RequestDurations()
    registry = CollectorRegistry()
    registry.register(durations)
    metrics = HttpMetrics(durations)
    route = _Route("/v1/jobs/{job_id}")

    async def crashing(scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = route
        raise RuntimeError("a bug")

    async def cancelled(scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = route
        raise asyncio.CancelledError

    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        sent.append(message)

    def scope() -> Scope:
        return {"type": "http", "method": "GET", "path": "/v1/jobs/j-1", "headers": [], "state": {}}

    await AccessLogAndCatchAll(crashing, metrics)(scope(), receive, send)
    assert sent[0]["status"] == 500
    with pytest.raises(asyncio.CancelledError):
        await AccessLogAndCatchAll(cancelled, metrics)(scope(), receive, send)
    s = Scrape.parse(generate_latest(registry).decode())
    assert _count(s, method="GET", route="/v1/jobs/{job_id}", status="500") == 1
    assert _count(s, method="GET", route="/v1/jobs/{job_id}", status="499") == 1
