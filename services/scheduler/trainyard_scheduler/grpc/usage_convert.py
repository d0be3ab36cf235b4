"""The UsageService's pb ↔ domain mapping (domain/usage.py), apart from the JobService's (convert.py)."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.scheduler.v1 import usage_pb2
from trainyard_core.errors import InvalidArgument

from ..domain.usage import Amount, Pricing, UsageReport, Window


def seconds_of(ts: Timestamp) -> float:
    # Not ToNanoseconds(): its float division of seconds keeps every nanosecond of a time only near the epoch.
    return ts.seconds + ts.nanos / 1e9


def timestamp_of(seconds: float) -> Timestamp:
    whole = int(seconds // 1)
    return Timestamp(seconds=whole, nanos=min(999_999_999, round((seconds - whole) * 1e9)))


def window_from_pb(request: usage_pb2.GetUsageRequest) -> Window:
    missing = [name for name in ("since", "until") if not request.HasField(name)]
    if missing:
        raise InvalidArgument(f"{' and '.join(missing)} must be set: a usage window is [since, until)")
    return Window(seconds_of(request.since), seconds_of(request.until))


def _row(group: str, a: Amount) -> usage_pb2.UsageRow:
    return usage_pb2.UsageRow(group=group, gpu_hours=a.gpu_hours, cpu_hours=a.cpu_hours, cost=a.cost_value,
                              unpriced_gpu_hours=a.unpriced_gpu_hours)


def report_to_pb(report: UsageReport, *, limit: int, computed_at: float,
                 pricing: Pricing) -> usage_pb2.GetUsageResponse:
    return usage_pb2.GetUsageResponse(
        since=timestamp_of(report.window.start), until=timestamp_of(report.window.end), group_by=report.group_by,
        rows=[_row(r.group, r.amount) for r in report.rows[:limit]], total=_row("", report.total),
        groups=len(report.rows), currency=report.currency,
        prices={model: float(price) for model, price in pricing.per_gpu_hour.items()},
        unpriced_models=list(report.unpriced_models), computed_at=timestamp_of(computed_at))
