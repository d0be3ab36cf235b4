"""Usage and cost: GPU-hours, CPU-hours and cost over a time window, grouped. Pure: the caller gathers the
intervals (the history store's usage records, the attempts still in etcd, the live allocations) and passes
`now` in.

An interval is one placed attempt of a job: its gang held `gpus` GPUs and `cpus` CPUs from `started_at` to
`ended_at`, or, while its allocation lives (`ended_at` None), up to `now`. Only the part inside the window
[start, end) counts, so an allocation that crosses a boundary is split there, and the two parts add up to the
whole exactly.

Exactness. Every time is counted in whole microseconds (each instant rounded on its own, so a boundary rounds
the same way for the window before it and the one after it), amounts are integers (GPU-microseconds) and
costs are fractions; nothing is rounded until a figure is shown. Hence for any window: the groups' amounts add
up to the total, the jobs' amounts add up to their team's, and two adjacent windows add up to the window that
spans both, each exactly. (The figures shown are floats made from the exact values, each correctly rounded:
summing the shown figures of the groups may differ from the shown total in the last few digits.)

Cost is GPU-hours times the price per GPU-hour of the interval's accelerator model (a gang of mixed models is
priced by its "+"-joined name, as its attempt record names it). A model without a price costs 0 and its hours
are counted as unpriced, per group and in total, and the model is named in `unpriced_models`: an answer never
makes unknown costs look like zero costs. CPU-hours cost nothing (only GPUs are priced).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from trainyard_core import contract as c
from trainyard_core.errors import InvalidArgument

US_PER_S = 1_000_000
US_PER_HOUR = 3600 * US_PER_S


def to_us(t: float) -> int:
    """A unix time (or duration) in seconds as whole microseconds."""
    return round(t * US_PER_S)


@dataclass(frozen=True, slots=True)
class Interval:
    """One placed attempt of a job and who it is accounted to."""

    job_id: str
    attempt: int
    team: str
    user: str
    project: str  # the job's "project" label, "" if none
    queue: str
    model: str  # accelerator model; models joined by "+" for a mixed gang; "" CPU-only
    gpus: int
    cpus: int
    started_at: float
    ended_at: float | None  # None: the allocation still holds its GPUs (counted up to `now`)

    def group(self, group_by: str) -> str:
        if group_by == "team":
            return self.team
        if group_by == "project":
            return self.project
        if group_by == "user":
            return self.user
        if group_by == "model":
            return self.model
        if group_by == "queue":
            return self.queue
        if group_by == "job":
            return self.job_id
        raise InvalidArgument(_group_rule(group_by))


def mixed_model(models: Iterable[str]) -> str:
    """The name an attempt's accelerator goes by: its model, or its models sorted and joined by "+" when the
    gang is mixed; "" for a CPU-only gang (domain.jobs.end_attempt names attempt records the same way)."""
    return "+".join(sorted({m for m in models if m}))


def _group_rule(group_by: str) -> str:
    return f"group_by must be one of {', '.join(c.USAGE_GROUPS)} (got {group_by[:40]!r})"


@dataclass(frozen=True, slots=True)
class Window:
    """[start, end) in unix seconds; end >= start (an empty window holds nothing)."""

    start: float
    end: float

    def __post_init__(self) -> None:
        if not self.end >= self.start:  # also refuses NaN
            raise InvalidArgument(f"the window ends ({self.end}) before it starts ({self.start}): give an end "
                                  "(until) at or after its start (since)")


def check_group_by(group_by: str) -> str:
    """`group_by`, or the default for ""; InvalidArgument naming the choices for anything else."""
    group_by = group_by or c.DEFAULT_USAGE_GROUP
    if group_by not in c.USAGE_GROUPS:
        raise InvalidArgument(_group_rule(group_by))
    return group_by


def _exact(value: float | str | Decimal | Fraction) -> Fraction:
    """A price as the number it was written as (2.49 is 249/100, not the binary float nearest to it)."""
    if isinstance(value, Fraction):
        return value
    try:
        return Fraction(Decimal(str(value)))
    except (InvalidOperation, ValueError, OverflowError):  # NaN, infinity, text that is no number
        raise ValueError(f"not a price: {value!r}") from None


@dataclass(frozen=True, slots=True)
class Pricing:
    """Prices per GPU-hour by accelerator model, in `currency`."""

    currency: str = "USD"
    per_gpu_hour: Mapping[str, Fraction] = field(default_factory=dict)

    @classmethod
    def of(cls, prices: Mapping[str, float | str | Decimal | Fraction], currency: str = "USD") -> Pricing:
        """ValueError for a currency that is not an ISO 4217 code or a price that is negative or not a number."""
        if not c.CURRENCY.matches(currency):
            raise ValueError(f"currency must be {c.CURRENCY.rule}, not {currency[:40]!r}")
        exact = {model: _exact(p) for model, p in prices.items()}
        bad = sorted(repr(m) for m, p in exact.items() if p < 0 or not m)
        if bad:
            raise ValueError(f"prices must be >= 0, for non-empty model names: {', '.join(bad)}")
        return cls(currency=currency, per_gpu_hour=exact)

    def price(self, model: str) -> Fraction | None:
        return self.per_gpu_hour.get(model)


@dataclass(frozen=True, slots=True)
class Amount:
    """Exact usage: GPU- and CPU-microseconds, the GPU-microseconds of models without a price, and the cost."""

    gpu_us: int = 0
    cpu_us: int = 0
    unpriced_gpu_us: int = 0
    cost: Fraction = Fraction(0)

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.gpu_us + other.gpu_us, self.cpu_us + other.cpu_us,
                      self.unpriced_gpu_us + other.unpriced_gpu_us, self.cost + other.cost)

    @property
    def gpu_hours(self) -> float:
        return self.gpu_us / US_PER_HOUR  # int / int: correctly rounded

    @property
    def cpu_hours(self) -> float:
        return self.cpu_us / US_PER_HOUR

    @property
    def unpriced_gpu_hours(self) -> float:
        return self.unpriced_gpu_us / US_PER_HOUR

    @property
    def cost_value(self) -> float:
        return float(self.cost)


@dataclass(frozen=True, slots=True)
class Row:
    group: str
    amount: Amount


@dataclass(frozen=True, slots=True)
class UsageReport:
    """Every group with any use in the window, the largest first (GPU-hours, then CPU-hours, then by name), and
    their total. `unpriced_models`: the models used in the window that have no price (sorted)."""

    window: Window
    group_by: str
    currency: str
    rows: tuple[Row, ...]
    total: Amount
    unpriced_models: tuple[str, ...]


def summarize(intervals: Iterable[Interval], window: Window, group_by: str, pricing: Pricing,
              now: float) -> UsageReport:
    """The usage of `intervals` in `window`, by `group_by` (one of contract.USAGE_GROUPS). Each attempt is to
    be given once (the caller merges its sources by job id and attempt)."""
    group_by = check_group_by(group_by)
    start_us, end_us, now_us = to_us(window.start), to_us(window.end), to_us(now)
    # Per group: GPU-microseconds per model (priced at the end: one exact product per group and model) and
    # CPU-microseconds.
    gpu: dict[str, dict[str, int]] = {}
    cpu: dict[str, int] = {}
    for it in intervals:
        end = to_us(it.ended_at) if it.ended_at is not None else now_us
        inside = min(end, end_us) - max(to_us(it.started_at), start_us)
        if inside <= 0 or (it.gpus <= 0 and it.cpus <= 0):
            continue
        key = it.group(group_by)
        if it.gpus > 0:
            models = gpu.setdefault(key, {})
            models[it.model] = models.get(it.model, 0) + it.gpus * inside
        if it.cpus > 0:
            cpu[key] = cpu.get(key, 0) + it.cpus * inside
    rows: list[Row] = []
    unpriced: set[str] = set()
    for key in gpu.keys() | cpu.keys():
        gpu_us = unpriced_us = 0
        cost = Fraction(0)
        for model, used in gpu.get(key, {}).items():
            gpu_us += used
            price = pricing.price(model)
            if price is not None:
                cost += Fraction(used * price.numerator, price.denominator * US_PER_HOUR)
            else:
                unpriced_us += used
                unpriced.add(model)
        rows.append(Row(key, Amount(gpu_us, cpu.get(key, 0), unpriced_us, cost)))
    rows.sort(key=lambda r: (-r.amount.gpu_us, -r.amount.cpu_us, r.group))
    total = sum((r.amount for r in rows), Amount())
    return UsageReport(window=window, group_by=group_by, currency=pricing.currency, rows=tuple(rows), total=total,
                       unpriced_models=tuple(sorted(unpriced)))
