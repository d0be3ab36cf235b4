"""The current health of every accelerator on this node, with a version for "what changed since".

A GPU's health is the worst of its findings. Each finding has a source and a `Verdict` (health, reason,
action); the GPU shows the worst health, the most severe action among its non-healthy findings, and the
reasons of all of them, worst first ("XID 79: GPU has fallen off the bus; GPU does not answer ...").

Sources and how their findings come and go:

    source      set by                          cleared by
    xid         an XID event (sticky)           an operator marking the GPU healthy
    operator    an operator: unhealthy (sticky) an operator marking the GPU healthy
    inventory   a GPU unreadable at start-up    an operator marking the GPU healthy
    lost        a poll the GPU did not answer   a poll it answers
    thermal     a hot or hardware-throttled GPU the temperature falling below limit - margin
    ecc, memory, nvlink, pcie                   the counters since the baseline no longer over a limit
                (counts above the baseline)     (they only grow: in practice, the operator's override)

Marking a GPU healthy (the operator's override, after a repair) drops every finding and moves the
counter baseline to the current counts, so errors already seen are acknowledged and only new ones count.
A condition still present (a lost GPU, a hot one) is found again by the next poll.

Every change of a GPU's (health, reason, action) bumps `version` and wakes `changes` waiters, so the
reporter pushes it at once instead of at the next heartbeat tick. Only the event loop mutates the book
(the monitor hands its thread's results back to the loop first).

Persistence: sticky findings (xid, operator) and baselines are written to `store` (a JSON file in the
state dir) keyed by GPU UUID, so an agent restart does not make a broken GPU look healthy. A finding that
asks for a host reboot is dropped once the host has rebooted (the boot id changed); baselines too, as the
driver's counters restart with the host.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..model import Accelerator, Action, Health, HealthCounters
from ..notify import Notifier
from .policy import Verdict

log = logging.getLogger(__name__)

STICKY = ("xid", "operator", "inventory")
MAX_REASON = 1000


class HealthBook:
    def __init__(self, accelerators: Sequence[Accelerator], *, store: Path | None = None, boot_id: str = "") -> None:
        self._gpus: list[Accelerator] = list(accelerators)
        self._findings: list[dict[str, Verdict]] = [{} for _ in self._gpus]
        self._baselines: list[HealthCounters] = [HealthCounters() for _ in self._gpus]
        self._changed_at: list[int] = [0] * len(self._gpus)
        self._store = store
        self._boot_id = boot_id
        self.version = 0
        self.changes = Notifier()
        for i, gpu in enumerate(self._gpus):
            if gpu.health > Health.HEALTHY:
                self._findings[i]["inventory"] = Verdict(gpu.health, gpu.health_reason, gpu.health_action)
        self._load()
        for i in range(len(self._gpus)):
            self._gpus[i] = self._summary(i)

    def __len__(self) -> int:
        return len(self._gpus)

    def all(self) -> tuple[Accelerator, ...]:
        return tuple(self._gpus)

    def get(self, index: int) -> Accelerator:
        return self._gpus[index]

    def findings(self, index: int) -> dict[str, Verdict]:
        return dict(self._findings[index])

    def baseline(self, index: int) -> HealthCounters:
        return self._baselines[index]

    def changed_since(self, version: int) -> list[Accelerator]:
        return [g for g, at in zip(self._gpus, self._changed_at, strict=True) if at > version]

    # --- findings ----------------------------------------------------------------------------------------

    def set_finding(self, index: int, source: str, verdict: Verdict | None) -> bool:
        """The current finding of `source` about GPU `index` (None: nothing wrong). True when the GPU's
        published state changed."""
        findings = self._findings[index]
        if verdict is None or verdict.health is Health.HEALTHY:
            if source not in findings:
                return False
            del findings[source]
        elif findings.get(source) == verdict:
            return False
        else:
            findings[source] = verdict
        if source in STICKY:
            self._save()
        return self._publish(index)

    def add_event(self, index: int, verdict: Verdict) -> bool:
        """An XID: kept until an operator clears it; a later XID replaces it only when it is worse (the first
        of equal ones is usually the cause, later ones its consequences)."""
        if verdict.health is Health.HEALTHY:
            return False
        current = self._findings[index].get("xid")
        if current is not None and (current.health, current.action.severity) >= (verdict.health,
                                                                                 verdict.action.severity):
            return False
        return self.set_finding(index, "xid", verdict)

    def mark_healthy(self, index: int, counters: HealthCounters | None) -> bool:
        """The operator's "repaired": drop every finding, acknowledge the counters seen so far."""
        self._findings[index].clear()
        if counters is not None:
            self._baselines[index] = counters
        self._save()
        return self._publish(index)

    def mark_unhealthy(self, index: int, reason: str) -> bool:
        return self.set_finding(index, "operator", Verdict(Health.UNHEALTHY, reason, Action.RESET_GPU))

    def _summary(self, index: int) -> Accelerator:
        gpu = self._gpus[index]
        bad = sorted(self._findings[index].values(), key=lambda v: (v.health, v.action.severity), reverse=True)
        if not bad:
            return gpu.with_health(Health.HEALTHY, "", Action.IGNORE)
        reason = "; ".join(dict.fromkeys(v.reason for v in bad))
        if len(reason) > MAX_REASON:
            reason = reason[:MAX_REASON - 1] + "…"
        return gpu.with_health(bad[0].health, reason, max((v.action for v in bad), key=lambda a: a.severity))

    def _publish(self, index: int) -> bool:
        current = self._gpus[index]
        updated = self._summary(index)
        if (updated.health, updated.health_reason, updated.health_action) == (
                current.health, current.health_reason, current.health_action):
            return False
        self._gpus[index] = updated
        self.version += 1
        self._changed_at[index] = self.version
        level = logging.WARNING if updated.health > current.health else logging.INFO
        log.log(level, "GPU health changed", extra={
            "gpu": index, "uuid": updated.uuid, "health": updated.health.name, "reason": updated.health_reason,
            "action": updated.wire_action, "previous": current.health.name})
        self.changes.notify()
        return True

    # --- persistence -------------------------------------------------------------------------------------

    def _save(self) -> None:
        if self._store is None:
            return
        gpus: dict[str, Any] = {}
        for gpu, findings, baseline in zip(self._gpus, self._findings, self._baselines, strict=True):
            sticky = {s: {"health": v.health.name.lower(), "reason": v.reason, "action": v.action.value}
                      for s, v in findings.items() if s in STICKY and s != "inventory"}
            if gpu.uuid and (sticky or baseline != HealthCounters()):
                gpus[gpu.uuid] = {"findings": sticky, "baseline": asdict(baseline)}
        tmp = self._store.with_name(self._store.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"boot_id": self._boot_id, "gpus": gpus}, indent=1))
            os.replace(tmp, self._store)
        except OSError as exc:
            log.error("cannot save GPU health to %s (an agent restart would forget it): %s", self._store, exc)

    def _load(self) -> None:
        if self._store is None or not self._store.exists():
            return
        try:
            data = json.loads(self._store.read_text())
            saved: dict[str, Any] = data["gpus"]
            rebooted = not self._boot_id or data.get("boot_id") != self._boot_id
            index_of = {g.uuid: g.index for g in self._gpus if g.uuid}
            for uuid, entry in saved.items():
                index = index_of.get(uuid)
                if index is None:
                    continue  # a GPU that was replaced
                for source, v in entry.get("findings", {}).items():
                    verdict = Verdict(Health[v["health"].upper()], str(v["reason"]), Action(v["action"]))
                    if rebooted and verdict.action is Action.REBOOT_HOST:
                        continue  # the reboot it asked for has happened
                    self._findings[index][source] = verdict
                if not rebooted:
                    self._baselines[index] = HealthCounters(**entry.get("baseline", {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # A damaged file must not keep the agent down; the operator sees the warning and the GPUs' state.
            log.error("ignoring unreadable saved GPU health in %s: %s", self._store, exc)


def read_boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """This boot of the host (Linux); empty where unknown, which makes every start look like a reboot."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
