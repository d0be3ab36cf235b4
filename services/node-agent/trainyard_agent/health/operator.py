"""The operator's override of a GPU's health (SetGpuHealth), audited.

Mark healthy: after a repair (reseated, reset, replaced in place) the GPU goes back into service; every
finding is dropped and the counters seen so far are acknowledged (book.py). Mark unhealthy: take a GPU out
of service by hand (reset_gpu: the node's other GPUs keep working); it stays out until marked healthy.

Each override is first appended to the audit log (`<state_dir>/gpu-health-audit.jsonl`, one JSON object
per line, fsynced) and logged as a structured line; if the record cannot be written the override is not
applied: an unaudited change must not happen.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from trainyard_core import contract
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.errors import FailedPrecondition, InvalidArgument, NotFound

from ..model import Accelerator, HealthCounters
from .book import HealthBook

log = logging.getLogger(__name__)

AUDIT_FILE = "gpu-health-audit.jsonl"
MAX_OPERATOR = 128
MAX_REASON = contract.MAX_GPU_HEALTH_REASON_LENGTH


def _text_field(name: str, value: str, limit: int, why: str) -> str:
    value = value.strip()
    if not value:
        raise InvalidArgument(f"{name} is required: {why}")
    if len(value) > limit:
        raise InvalidArgument(f"{name} is {len(value)} characters long; at most {limit} are allowed")
    if any(not ch.isprintable() for ch in value):
        raise InvalidArgument(f"{name} contains control characters (newlines, tabs, ...); use one line of text")
    return value


class AuditLog:
    """Append-only JSON lines. `append` is durable when it returns."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, record: dict[str, object]) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def records(self) -> list[dict[str, object]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


class HealthOverrides:
    def __init__(self, book: HealthBook, audit: AuditLog, *, node_id: str,
                 counters: Callable[[int], HealthCounters | None], clock: Clock | None = None) -> None:
        self._book = book
        self._audit = audit
        self._node_id = node_id
        self._counters = counters
        self._clock = clock or SystemClock()

    def set_health(self, gpu_index: int, *, healthy: bool, operator: str, reason: str) -> Accelerator:
        """Validate, audit, apply; returns the GPU as it is afterwards. Idempotent in effect (marking a
        healthy GPU healthy changes nothing), but every call is audited."""
        if not 0 <= gpu_index < len(self._book):
            gpus = f"GPUs 0-{len(self._book) - 1}" if len(self._book) else "no GPUs"
            raise NotFound(f"GPU {gpu_index} does not exist on node {self._node_id} (it has {gpus})")
        operator = _text_field("operator", operator, MAX_OPERATOR, "who changes the GPU's health, for the audit log")
        reason = _text_field("reason", reason, MAX_REASON, "why the GPU's health is changed (e.g. 'reseated after "
                                                          "XID 79, passed dcgmi diag'), for the audit log")
        before = self._book.get(gpu_index)
        record: dict[str, object] = {
            "at": self._clock.now(), "node_id": self._node_id, "gpu": gpu_index, "uuid": before.uuid,
            "set": "healthy" if healthy else "unhealthy", "operator": operator, "reason": reason,
            "previous": {"health": before.health.name.lower(), "reason": before.health_reason,
                         "action": before.wire_action}}
        try:
            self._audit.append(record)
        except OSError as exc:
            raise FailedPrecondition(f"cannot write the audit log {self._audit.path} ({exc.strerror}); "
                                     "the GPU's health was not changed") from exc
        log.warning("GPU health set by an operator", extra={k: v for k, v in record.items() if k != "at"})
        if healthy:
            self._book.mark_healthy(gpu_index, self._counters(gpu_index))
        else:
            self._book.mark_unhealthy(gpu_index, f"marked unhealthy by {operator}: {reason}")
        return self._book.get(gpu_index)
