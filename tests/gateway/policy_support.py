"""The scheduler address the gateway's and the CLI's queue/quota tests talk to: the cluster's own scheduler,
which serves PolicyService next to JobService."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from .support import Cluster


@contextlib.asynccontextmanager
async def policy_endpoint(cluster: Cluster) -> AsyncIterator[str]:
    yield cluster.address
