"""Health policy as data: which fault makes a GPU degraded or unhealthy, and what should be done.

`XID_RULES` maps NVIDIA XID codes to an action and a health state. Application-class XIDs (a bug or an
OOM in the user's program, e.g. 13, 31, 43, 45, 68, 109) leave the GPU healthy: no node is drained for
them. Issue 3 makes this table complete and configurable per site; the shape stays the same.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..model import Health


class Action(enum.StrEnum):
    IGNORE = "ignore"  # application error: the job fails or restarts, the hardware is fine
    RESTART_JOB = "restart_job"
    RESET_GPU = "reset_gpu"
    DRAIN_NODE = "drain_node"
    REBOOT_HOST = "reboot_host"


@dataclass(frozen=True)
class XidRule:
    xid: int
    action: Action
    health: Health
    description: str


def _rules(*rules: XidRule) -> dict[int, XidRule]:
    return {r.xid: r for r in rules}


XID_RULES: dict[int, XidRule] = _rules(
    XidRule(13, Action.IGNORE, Health.HEALTHY, "graphics engine exception (application error)"),
    XidRule(31, Action.IGNORE, Health.HEALTHY, "GPU memory page fault (application error)"),
    XidRule(43, Action.IGNORE, Health.HEALTHY, "GPU stopped processing (application error)"),
    XidRule(45, Action.IGNORE, Health.HEALTHY, "preemptive cleanup after an earlier error"),
    XidRule(68, Action.IGNORE, Health.HEALTHY, "video processor exception (application error)"),
    XidRule(109, Action.IGNORE, Health.HEALTHY, "context switch timeout (application error)"),
    XidRule(48, Action.RESET_GPU, Health.UNHEALTHY, "double-bit ECC error"),
    XidRule(63, Action.RESTART_JOB, Health.DEGRADED, "ECC page retirement or row remapping recorded"),
    XidRule(64, Action.RESET_GPU, Health.UNHEALTHY, "ECC page retirement or row remapping failed"),
    XidRule(74, Action.RESET_GPU, Health.UNHEALTHY, "NVLink error"),
    XidRule(79, Action.REBOOT_HOST, Health.UNHEALTHY, "GPU has fallen off the bus"),
    XidRule(92, Action.RESTART_JOB, Health.DEGRADED, "high single-bit ECC error rate"),
    XidRule(94, Action.RESTART_JOB, Health.DEGRADED, "contained ECC error"),
    XidRule(95, Action.RESET_GPU, Health.UNHEALTHY, "uncontained ECC error"),
    XidRule(119, Action.RESET_GPU, Health.UNHEALTHY, "GSP RPC timeout"),
    XidRule(120, Action.RESET_GPU, Health.UNHEALTHY, "GSP error"),
)

# A XID this table does not know is treated as suspicious but not fatal.
UNKNOWN_XID = XidRule(0, Action.RESTART_JOB, Health.DEGRADED, "unknown XID; see NVIDIA's XID catalog")

# Uncorrectable ECC errors since boot: degraded from the first, unhealthy from this many.
ECC_UNHEALTHY_AT = 10
# Temperature that NVIDIA parts start slowing down at; above it a GPU is degraded.
THERMAL_SLOWDOWN_C = 87


@dataclass(frozen=True)
class Verdict:
    health: Health
    reason: str
    action: Action


def for_xid(xid: int) -> Verdict:
    rule = XID_RULES.get(xid, UNKNOWN_XID)
    return Verdict(rule.health, f"XID {xid}: {rule.description}", rule.action)


def for_lost(detail: str) -> Verdict:
    return Verdict(Health.UNHEALTHY, f"XID 79: GPU has fallen off the bus ({detail})", Action.REBOOT_HOST)


def for_ecc(total_uncorrectable: int) -> Verdict:
    health = Health.UNHEALTHY if total_uncorrectable >= ECC_UNHEALTHY_AT else Health.DEGRADED
    action = Action.RESET_GPU if health is Health.UNHEALTHY else Action.RESTART_JOB
    return Verdict(health, f"{total_uncorrectable} uncorrectable ECC errors", action)


def for_temperature(celsius: int) -> Verdict:
    if celsius >= THERMAL_SLOWDOWN_C:
        return Verdict(Health.DEGRADED, f"thermal slowdown at {celsius} °C", Action.IGNORE)
    return Verdict(Health.HEALTHY, "", Action.IGNORE)
