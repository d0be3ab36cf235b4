"""Rate limits per token: the token buckets on a manual clock, and 429 with Retry-After through a real
gateway."""

from __future__ import annotations

import pytest

from trainyard_core.clock import ManualClock
from trainyard_core.testing.etcd import free_port
from trainyard_gateway.rate_limit import RateLimited, TokenBuckets
from trainyard_gateway.tokens import new_secret

from .support import running_gateway


def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    clock = ManualClock()
    buckets = TokenBuckets(rate_per_s=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # one request refills in 1/rate s
    assert buckets.take("b") == 0.0  # every token has its own bucket
    clock.advance(0.5)
    assert buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(0.5)
    clock.advance(60)
    assert [buckets.take("a") for _ in range(4)][-1] > 0  # refilled up to the burst, not beyond


def test_refusal_names_the_limit_and_rounds_retry_after_up() -> None:
    clock = ManualClock()
    buckets = TokenBuckets(rate_per_s=0.25, burst=1, clock=clock)
    buckets.check("tok-a", "alice")
    with pytest.raises(RateLimited) as info:
        buckets.check("tok-a", "alice")
    assert info.value.retry_after_s == 4 and "0.25 requests/s" in info.value.message
    clock.advance(3.5)
    with pytest.raises(RateLimited) as info:
        buckets.check("tok-a", "alice")
    assert info.value.retry_after_s == 1  # 0.5 s left: at least 1


def test_the_table_stays_bounded_and_forgets_only_full_buckets_first() -> None:
    clock = ManualClock()
    buckets = TokenBuckets(rate_per_s=1.0, burst=2, max_buckets=3, clock=clock)
    for key in ("a", "b", "c"):
        buckets.take(key)
    clock.advance(1.0)  # a, b, c are full again
    buckets.take("d")
    assert len(buckets) == 1  # the full (idle) ones were forgotten: nothing lost
    for key in ("e", "f", "g", "h"):
        buckets.take(key)
        buckets.take(key)  # empty, not refilled (no time passes)
    assert len(buckets) == 3
    assert buckets.take("h") > 0  # the most recent keep their state
    assert TokenBuckets(0, 1, clock=clock).take("x") == 0.0  # rate 0: off


async def test_429_with_retry_after_after_the_burst(etcd_settings: dict[str, str], key_prefix: str) -> None:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}", rate_limit_per_s=0.01,
                               rate_limit_burst=3) as gw:
        # The bootstrap operator token is limited too: creating these spends two of its three.
        alice, bob = await gw.create_token("vision", "alice"), await gw.create_token("vision", "bob")
        async with gw.client(alice) as http:
            assert [(await http.get("/v1/queues")).status_code for _ in range(3)] == [503, 503, 503]
            refused = await http.post("/v1/jobs", json={"name": "x", "command": ["true"],
                                                        "resources": {"nodes": 1, "gpus_per_node": 1}})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "resource_exhausted"
            assert "rate limit of alice's token exceeded" in refused.json()["error"]["message"]
            retry_after = refused.headers["retry-after"]
            assert retry_after.isdigit() and 1 <= int(retry_after) <= 100
        async with gw.client(bob) as http:  # another token, its own bucket
            assert (await http.get("/v1/queues")).status_code == 503
        limiter = gw.app.app.state.deps.limiter if gw.app.app is not None else None
        assert limiter is not None
        known = len(limiter)
        async with gw.client(new_secret()) as http, gw.client() as anonymous:
            for _ in range(10):  # unauthenticated requests are answered 401 and spend no bucket
                assert (await http.get("/v1/queues")).status_code == 401
                assert (await anonymous.get("/v1/queues")).status_code == 401
        assert len(limiter) == known
