"""The gateway's HTTP metrics, recorded by the access log (`http_errors.AccessLogAndCatchAll`) for every request:

    trainyard_gateway_http_request_duration_seconds{method, route, status}   (histogram)
    trainyard_gateway_http_requests_in_flight

`route` is the template the request matched (`/v1/jobs/{job_id}`), never the path: a job id in a label would
make a series per job. A request no route matched (an unknown path, a method answered 405 or OPTIONS before
routing) is `unmatched`. `method` is the request's method when it is one the API could serve, else `other`;
`status` the status sent (500 for a request that crashed; 499, nginx's "client closed request", for one whose
caller went away before an answer began). The duration runs from the request's arrival at the access log to
the end of its answer, as the access log's `duration_ms` does: for a change, the audit entry written before
the answer is in it; for a stream (log follow, events), its whole life.

The gateway's reads are its hot path (bench/gateway), so a request costs a dictionary look-up of the series
kept for its (route, method, status), a bisection of the buckets and three additions to plain numbers; the
exposition is built from them when /metrics is scraped (`RequestDurations`). prometheus_client's Histogram and
Gauge take a lock per step (measured with direct ASGI GETs through the gateway's middleware, the median of 60
paired rounds: 3.2 µs a request with them, 1.4 µs this way). Labels are made once per combination; the
combinations are bounded by the routes, the methods below and the status codes.

The numbers are changed only on the event loop's thread (uvicorn serves there) and read by the scrape's; each
read is whole under the GIL, and a scrape that lands between a request's count and its sum sees the sum one
request behind, which the next scrape makes good.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.types import Scope

DURATION_NAME = "trainyard_gateway_http_request_duration_seconds"
DURATION_HELP = "Time to answer an HTTP request, by method, route template and status code"
DURATION_LABELS = ("method", "route", "status")
BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                              60.0)
_BOUNDS = (*(repr(b) for b in BUCKETS), "+Inf")  # the `le` labels, as prometheus_client writes them

UNMATCHED = "unmatched"
OTHER_METHOD = "other"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class _Series:
    """One label set's observations: per bucket (not cumulative; the last is above every bound) and the sum."""

    __slots__ = ("counts", "labels", "total")

    def __init__(self, labels: tuple[str, str, str]) -> None:
        self.labels = labels
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0


class RequestDurations(Collector):
    """The request-duration histogram, exposed from plain per-series counts."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, str, str], _Series] = {}

    def series(self, method: str, route: str, status: str) -> _Series:
        labels = (method, route, status)
        found = self._series.get(labels)
        if found is None:
            found = self._series[labels] = _Series(labels)
        return found

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(DURATION_NAME, DURATION_HELP, labels=DURATION_LABELS)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(DURATION_NAME, DURATION_HELP, labels=DURATION_LABELS)
        for series in list(self._series.values()):
            counts = list(series.counts)
            buckets = []
            seen = 0
            for bound, count in zip(_BOUNDS, counts, strict=True):
                seen += count
                buckets.append((bound, float(seen)))
            family.add_metric(series.labels, buckets, series.total)
        yield family


class _InFlight:
    """Requests being answered by every gateway app of the process."""

    count = 0


DURATIONS = RequestDurations()
REGISTRY.register(DURATIONS)
IN_FLIGHT = Gauge("trainyard_gateway_http_requests_in_flight", "HTTP requests being answered (streams included)")
IN_FLIGHT.set_function(lambda: float(_InFlight.count))


class HttpMetrics:
    """Keeps the series of each (route, method, status), the route known by its identity (FastAPI's routes are
    not hashable, and comparing them would cost more than the look-up). The entry holds the route, so its id
    cannot be reused by another object while the entry exists."""

    def __init__(self, durations: RequestDurations = DURATIONS) -> None:
        self._durations = durations
        self._series: dict[tuple[int, str, int], tuple[Any, _Series]] = {}

    def began(self) -> None:
        """A request arrived (every `began` is followed by one `observe`, when it is answered)."""
        _InFlight.count += 1

    def observe(self, scope: Scope, status: int, seconds: float) -> None:
        """The request of `scope` was answered with `status` after `seconds`."""
        _InFlight.count -= 1
        route = scope.get("route")
        method = scope.get("method")
        if method not in METHODS:
            method = OTHER_METHOD
        key = (id(route), method, status)
        entry = self._series.get(key)
        if entry is None or entry[0] is not route:
            template = getattr(route, "path", None)
            entry = self._series[key] = (route, self._durations.series(
                method, template if isinstance(template, str) and template else UNMATCHED, str(status)))
        series = entry[1]
        series.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        series.total += seconds
