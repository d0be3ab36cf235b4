"""What one transaction may carry on this store, found by asking it (etcd's --max-txn-ops is a server
flag no client API reports, and members are configured by operators, not by us)."""

from __future__ import annotations

import logging

from ..errors import InvalidArgument
from .api import Compare, Store

log = logging.getLogger(__name__)


async def txn_ops_limit(store: Store, probe_key: str, most: int) -> int:
    """The largest number of compares (≤ `most`) one transaction is accepted with, by bisection over
    read-only transactions on `probe_key` (about log2(most) round trips; a store without a limit answers
    `most` at the first). etcd applies one limit to each side of a transaction, so this bounds writes too.
    Raises Unavailable when the store cannot be reached."""

    async def accepted(n: int) -> bool:
        try:
            await store.txn([Compare(probe_key, "version", ">", -1)] * n, [])
            return True
        except InvalidArgument as exc:
            log.debug("store refused a transaction of %d compares: %s", n, exc)
            return False

    if await accepted(most):
        return most
    lo, hi = 1, most  # lo accepted (etcd takes at least one), hi refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await accepted(mid):
            lo = mid
        else:
            hi = mid
    return lo
