"""SDK fixtures: the gateway's (tests/gateway/conftest.py: a real gateway alone, in front of a real scheduler
without nodes, or of a real scheduler with two real agents), and `sdk`, which runs every test that takes it
twice: once with the synchronous `Client`, once with the `AsyncClient` (support.py).

The gateway runs in the test's event loop, so the synchronous client is driven from a worker thread (as a
script would call it from its own), and the asynchronous one in the loop. `await api(lambda c: c.get_job(id))`
is the same line for both: a coroutine is awaited, a listing or a stream is read to its end into a list.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.gateway.conftest import cluster, cluster_gateway, gateway, live_gateway, scheduler

from .support import Sdk

__all__ = ["cluster", "cluster_gateway", "gateway", "live_gateway", "scheduler"]


@pytest.fixture(params=["sync", "async"])
async def sdk(request: pytest.FixtureRequest) -> AsyncIterator[Sdk]:
    made = Sdk(request.param)
    try:
        yield made
    finally:
        await made.close()
