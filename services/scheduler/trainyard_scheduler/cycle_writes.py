"""How the leader's cycle takes the outcome of each of its writes.

Every write a cycle makes is CAS-guarded on the revision its snapshot read. A write that fails is not the
cycle's failure: the next cycle, from a mirror that has caught up, decides again for that job. What a failure
means differs, though, and is said once here for every caller (reconcile.py, placement_writes.py):
- a lost race (Conflict): someone wrote the record since; quiet, the next cycle sees the new one;
- the GPU holdings refused a gang (HeldElsewhere): with a caught-up mirror, the holdings and the allocations
  disagree, so the reconciler makes them agree again before its next cycle (`take_holdings_refusal`);
- the store unavailable: logged, tried again next cycle;
- the store refused the request itself (over etcd's --max-txn-ops or request size): only this write fails.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable

from trainyard_core.errors import Conflict, InvalidArgument, Unavailable

from . import metrics
from .state.holdings import HeldElsewhere

log = logging.getLogger(__name__)


class CycleWrites:
    def __init__(self) -> None:
        self._holdings_refused = False

    async def attempt(self, write: Awaitable[int]) -> bool:
        """Whether `write` was stored; a failure is logged as its kind deserves and never raised."""
        try:
            await write
            return True
        except HeldElsewhere as exc:
            metrics.PLACEMENT_CONFLICTS.inc()
            log.warning("placement refused by the GPU holdings: %s", exc)
            self._holdings_refused = True
        except Conflict as exc:
            metrics.PLACEMENT_CONFLICTS.inc()
            log.debug("write lost a race, will retry next cycle: %s", exc)
        except Unavailable as exc:
            log.warning("write failed, store unavailable: %s", exc)
        except InvalidArgument as exc:
            log.error("the store refused a write: %s", exc)
        return False

    def take_holdings_refusal(self) -> bool:
        """Whether the holdings refused a placement since the last call (then the holdings need reconciling)."""
        refused, self._holdings_refused = self._holdings_refused, False
        return refused
