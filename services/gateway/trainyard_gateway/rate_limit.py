"""Rate limits per token: a token bucket per token id, in this process.

Each token may make `burst` requests at once and `rate_per_s` a second after that (every request costs
one, read or write). A request over the limit is refused with 429 `resource_exhausted` and `Retry-After`,
the whole seconds until the bucket holds a request again (at least 1). Requests without a valid token are
not counted here: they are refused with 401 before any bucket is looked at.

The buckets live in the memory of one gateway replica: behind a load balancer that spreads a token's
requests over N replicas, the token gets up to N times the limit. The table is bounded: a bucket idle long
enough to be full again is forgotten (losslessly: a new one starts full), and beyond `max_buckets` the least
recently used bucket is dropped even if it was not full yet.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from trainyard_core.clock import Clock, SystemClock
from trainyard_core.errors import ResourceExhausted

DEFAULT_MAX_BUCKETS = 100_000


class RateLimited(ResourceExhausted):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float  # monotonic time `tokens` was computed


class TokenBuckets:
    """`take(key)` spends one request of `key`'s bucket, or says how long to wait. `rate_per_s` 0: no limit."""

    def __init__(self, rate_per_s: float, burst: int, *, max_buckets: int = DEFAULT_MAX_BUCKETS,
                 clock: Clock | None = None) -> None:
        if rate_per_s < 0 or burst < 1 or max_buckets < 1:
            raise ValueError("rate_per_s must be >= 0, burst and max_buckets >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._max = max_buckets
        self._clock = clock or SystemClock()
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def _refilled(self, bucket: _Bucket, now: float) -> float:
        return min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate_per_s)

    def take(self, key: str) -> float:
        """0.0 when the request may go on (and is counted), else the seconds until it could."""
        if not self.enabled:
            return 0.0
        now = self._clock.monotonic()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._evict(now)
            bucket = self._buckets[key] = _Bucket(tokens=float(self.burst), at=now)
        else:
            self._buckets.move_to_end(key)
            bucket.tokens, bucket.at = self._refilled(bucket, now), now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s

    def _evict(self, now: float) -> None:
        # Before a new bucket is added, least recently used first: drop those full again (a new bucket starts
        # full, so nothing is lost), and while at the bound the oldest whatever its level.
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            if len(self._buckets) < self._max and self._refilled(oldest, now) < self.burst:
                return
            self._buckets.popitem(last=False)

    def check(self, key: str, who: str) -> None:
        """RateLimited (429 with Retry-After) when `key` is over its limit."""
        wait = self.take(key)
        if wait > 0:
            seconds = max(1, math.ceil(wait))
            raise RateLimited(f"rate limit of {who}'s token exceeded ({self.rate_per_s:g} requests/s, bursts of "
                              f"{self.burst}); retry in {seconds}s", seconds)
