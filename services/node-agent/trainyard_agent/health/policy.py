"""Health policy as data: which fault makes a GPU degraded or unhealthy, and what should be done about it.

`HealthPolicy` = the XID table (`xid_catalog.py`, every XID → action, health, description) + thresholds
for the error counters and temperature. Each method turns one observation into a `Verdict` (health, an
operator-readable reason, an action), or None when the observation is harmless. The methods are pure:
health/book.py keeps the resulting state, health/monitor.py feeds the observations.

A site adjusts the policy with a YAML or JSON file (setting `health_policy_file`):

    xids:                       # rows replaced or added; health defaults from the action
      79: {action: drain_node}
      48: {action: reset_gpu, health: unhealthy, description: "double-bit ECC (site rule)"}
    unknown_xid: {action: restart_job, health: degraded}
    thresholds:
      ecc_uncorrected_unhealthy_at: 4
      temperature_degraded_c: 85

The file is validated as a whole at start-up; any mistake stops the agent with the file, the entry and
what is wrong. Rules that cannot be overridden: an application-class XID (13, 31, 43, 45, 68, 109) never
makes a GPU unhealthy nor drains a node; a healthy verdict asks for nothing; drain_node and reboot_host
come with unhealthy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainyard_core.errors import InvalidArgument
from trainyard_core.files import read_structured

from ..model import Action, Health, HealthCounters
from .xid_catalog import APPLICATION_XIDS, UNKNOWN_XID, XID_CATALOG

HealthName = Literal["healthy", "degraded", "unhealthy"]
_HEALTH_BY_NAME: dict[str, Health] = {"healthy": Health.HEALTHY, "degraded": Health.DEGRADED,
                                      "unhealthy": Health.UNHEALTHY}
# Throttle reasons the agent knows (nvml/api.py THROTTLE_REASONS).
KNOWN_THROTTLE_REASONS = frozenset({"applications_clocks", "sw_power_cap", "hw_slowdown", "sync_boost",
                                    "sw_thermal", "hw_thermal", "hw_power_brake", "display_clocks"})
MAX_XID = 999


class PolicyError(InvalidArgument):
    """The site's health policy file is unreadable or invalid."""


@dataclass(frozen=True)
class XidRule:
    xid: int
    action: Action
    health: Health
    description: str


@dataclass(frozen=True)
class Verdict:
    health: Health
    reason: str
    action: Action


class Thresholds(BaseModel):
    """Limits on the error counters and temperature. A count is what grew since an operator last marked the
    GPU healthy (or since the driver started counting); 0 turns a count limit off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ecc_uncorrected_degraded_at: int = Field(1, ge=0, description="volatile uncorrectable ECC errors → degraded "
                                                                  "(restart_job)")
    ecc_uncorrected_unhealthy_at: int = Field(10, ge=0, description="... → unhealthy (reset_gpu)")
    remapped_rows_pending: HealthName = Field("degraded", description="a row remap awaits a GPU reset "
                                                                      "(reset_gpu)")
    remapped_rows_failure: HealthName = Field("unhealthy", description="row remapping failed: RMA (drain_node)")
    retired_pages_pending: HealthName = Field("degraded", description="a page retirement awaits a GPU reset "
                                                                      "(reset_gpu)")
    retired_pages_unhealthy_at: int = Field(60, ge=0, description="retired pages → unhealthy (drain_node)")
    temperature_degraded_c: int = Field(87, ge=0, le=150, description="GPU temperature → degraded; 0 off")
    # Hysteresis: a hot GPU is healthy again only this far below the limit, so it does not flap.
    temperature_clear_margin_c: int = Field(3, ge=0, le=30)
    throttle_reasons_degraded: tuple[str, ...] = Field(
        ("hw_slowdown", "hw_thermal", "hw_power_brake"),
        description="active clock throttle reasons that make a GPU degraded")
    nvlink_errors_degraded_at: int = Field(0, ge=0, description="NVLink data-link errors → degraded; 0 off")
    pcie_replays_degraded_at: int = Field(0, ge=0, description="PCIe replays → degraded; 0 off")

    @field_validator("throttle_reasons_degraded")
    @classmethod
    def _known_reasons(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(v) - KNOWN_THROTTLE_REASONS)
        if unknown:
            raise ValueError(f"unknown throttle reason(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(KNOWN_THROTTLE_REASONS))}")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> Thresholds:
        low, high = self.ecc_uncorrected_degraded_at, self.ecc_uncorrected_unhealthy_at
        if low and high and low > high:
            raise ValueError(f"ecc_uncorrected_degraded_at ({low}) must not be above ecc_uncorrected_unhealthy_at "
                             f"({high})")
        return self


class HealthPolicy:
    def __init__(self, rules: Mapping[int, XidRule], unknown: XidRule, thresholds: Thresholds) -> None:
        self.rules = dict(rules)
        self.unknown = unknown
        self.thresholds = thresholds

    def rule(self, xid: int) -> XidRule:
        return self.rules.get(xid) or XidRule(xid, self.unknown.action, self.unknown.health, self.unknown.description)

    def xid(self, xid: int) -> Verdict:
        rule = self.rule(xid)
        return Verdict(rule.health, f"XID {xid}: {rule.description}", rule.action)

    def lost(self, detail: str) -> Verdict:
        """A GPU that stopped answering the driver: what XID 79 (fallen off the bus) asks for."""
        action = self.rules[79].action if 79 in self.rules else Action.REBOOT_HOST
        return Verdict(Health.UNHEALTHY, f"GPU does not answer the driver ({detail})", action)

    def counters(self, c: HealthCounters) -> dict[str, Verdict | None]:
        """One verdict per kind of counter ("ecc", "memory", "nvlink", "pcie"); None where all is well.
        `c` holds the counts since the operator's last acknowledgement (HealthCounters.since)."""
        t = self.thresholds
        out: dict[str, Verdict | None] = {}
        ecc = c.ecc_volatile_uncorrected
        if t.ecc_uncorrected_unhealthy_at and ecc >= t.ecc_uncorrected_unhealthy_at:
            out["ecc"] = Verdict(Health.UNHEALTHY, f"{ecc} uncorrectable ECC errors (limit "
                                                   f"{t.ecc_uncorrected_unhealthy_at})", Action.RESET_GPU)
        elif t.ecc_uncorrected_degraded_at and ecc >= t.ecc_uncorrected_degraded_at:
            out["ecc"] = Verdict(Health.DEGRADED, f"{ecc} uncorrectable ECC error(s)", Action.RESTART_JOB)
        else:
            out["ecc"] = None
        out["memory"] = self._memory(c)
        out["nvlink"] = _count_limit(c.nvlink_errors, t.nvlink_errors_degraded_at, "NVLink errors")
        out["pcie"] = _count_limit(c.pcie_replays, t.pcie_replays_degraded_at, "PCIe replays")
        return out

    def _memory(self, c: HealthCounters) -> Verdict | None:
        t = self.thresholds
        findings: list[Verdict] = []
        if c.remapped_rows_failure:
            findings.append(_named(t.remapped_rows_failure, "row remapping failed: the GPU needs replacing",
                                   Action.DRAIN_NODE))
        if t.retired_pages_unhealthy_at and c.retired_pages >= t.retired_pages_unhealthy_at:
            findings.append(Verdict(Health.UNHEALTHY, f"{c.retired_pages} retired memory pages (limit "
                                                      f"{t.retired_pages_unhealthy_at})", Action.DRAIN_NODE))
        if c.remapped_rows_pending:
            findings.append(_named(t.remapped_rows_pending, "a row remapping waits for a GPU reset",
                                   Action.RESET_GPU))
        if c.retired_pages_pending:
            findings.append(_named(t.retired_pages_pending, "a page retirement waits for a GPU reset",
                                   Action.RESET_GPU))
        findings = [f for f in findings if f.health > Health.HEALTHY]
        if not findings:
            return None
        worst = max(findings, key=lambda f: (f.health, f.action.severity))
        return Verdict(worst.health, "; ".join(f.reason for f in findings), worst.action)

    def thermal(self, temperature_c: int, throttle_reasons: tuple[str, ...], *, flagged: bool) -> Verdict | None:
        """Degraded while the GPU is hot or its clocks are held down by hardware; `flagged` says whether it
        already is (the temperature must then fall below the limit by the margin to clear)."""
        t = self.thresholds
        parts = []
        limit = t.temperature_degraded_c
        if limit and (temperature_c >= limit or (flagged and temperature_c > limit - t.temperature_clear_margin_c)):
            parts.append(f"thermal slowdown at {temperature_c} °C (limit {limit} °C)")
        throttled = [r for r in throttle_reasons if r in t.throttle_reasons_degraded]
        if throttled:
            parts.append(f"clocks throttled by {', '.join(throttled)}")
        if not parts:
            return None
        return Verdict(Health.DEGRADED, "; ".join(parts), Action.IGNORE)


def _named(health: str, reason: str, action: Action) -> Verdict:
    h = _HEALTH_BY_NAME[health]
    # A drain for a GPU the site calls merely degraded would contradict itself: ask for a reset instead.
    if h is not Health.UNHEALTHY and action.drains_node:
        action = Action.RESET_GPU
    return Verdict(h, reason, action if h > Health.HEALTHY else Action.IGNORE)


def _count_limit(count: int, limit: int, what: str) -> Verdict | None:
    if limit and count >= limit:
        return Verdict(Health.DEGRADED, f"{count} {what} (limit {limit})", Action.IGNORE)
    return None


def _catalog_rules() -> dict[int, XidRule]:
    return {xid: XidRule(xid, action, health, description) for xid, action, health, description in XID_CATALOG}


def default_policy() -> HealthPolicy:
    action, health, description = UNKNOWN_XID
    return HealthPolicy(_catalog_rules(), XidRule(0, action, health, description), Thresholds.model_validate({}))


# --- the site's policy file ---------------------------------------------------------------------------------


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Action
    health: HealthName | None = None
    description: str | None = Field(None, min_length=1, max_length=200)

    def rule(self, xid: int, base: XidRule | None) -> XidRule:
        health = _HEALTH_BY_NAME[self.health] if self.health else _default_health(self.action)
        description = self.description or (base.description if base else f"site rule for XID {xid}")
        return XidRule(xid, self.action, health, description)


class _PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    xids: dict[int, _Entry] = Field(default_factory=dict)
    unknown_xid: _Entry | None = None
    thresholds: dict[str, Any] = Field(default_factory=dict)


def _default_health(action: Action) -> Health:
    if action is Action.IGNORE:
        return Health.HEALTHY
    return Health.DEGRADED if action is Action.RESTART_JOB else Health.UNHEALTHY


def _check_rule(where: str, rule: XidRule) -> None:
    if rule.health is Health.HEALTHY and rule.action is not Action.IGNORE:
        raise ValueError(f"{where}: health healthy with action {rule.action.value} contradicts itself "
                         "(a healthy GPU needs nothing done: use action ignore)")
    if rule.action.drains_node and rule.health is not Health.UNHEALTHY:
        raise ValueError(f"{where}: action {rule.action.value} needs health unhealthy")
    if rule.xid in APPLICATION_XIDS and (rule.health is Health.UNHEALTHY or rule.action.drains_node
                                         or rule.action is Action.RESET_GPU):
        raise ValueError(f"{where}: XID {rule.xid} is an application error (the user's program faulted, not the "
                         "GPU); it may not make a GPU unhealthy, reset it or drain the node. Use ignore or "
                         "restart_job")


def policy_from_data(data: Any, source: str) -> HealthPolicy:
    """The default policy with the overrides of `data` (a site file's content). Raises PolicyError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"health policy file {source} must hold a mapping with xids, unknown_xid and/or "
                          "thresholds")
    try:
        parsed = _PolicyFile.model_validate(data)
    except ValidationError as e:
        raise PolicyError(f"health policy file {source}: {_describe(e)}") from None
    base = default_policy()
    rules = dict(base.rules)
    try:
        for xid, entry in sorted(parsed.xids.items()):
            if not 1 <= xid <= MAX_XID:
                raise ValueError(f"xids.{xid}: an XID is a number from 1 to {MAX_XID}")
            rules[xid] = entry.rule(xid, base.rules.get(xid))
            _check_rule(f"xids.{xid}", rules[xid])
        unknown = parsed.unknown_xid.rule(0, base.unknown) if parsed.unknown_xid else base.unknown
        _check_rule("unknown_xid", unknown)
    except ValueError as e:
        raise PolicyError(f"health policy file {source}: {e}") from None
    try:
        thresholds = Thresholds.model_validate({**base.thresholds.model_dump(), **parsed.thresholds})
    except ValidationError as e:
        raise PolicyError(f"health policy file {source}: {_describe(e, prefix='thresholds.')}") from None
    return HealthPolicy(rules, unknown, thresholds)


def load_policy(path: str) -> HealthPolicy:
    """The policy for this agent: the default, or the default with the site file at `path` applied."""
    if not path:
        return default_policy()
    try:
        data = read_structured(path, "health policy file")
    except InvalidArgument as e:
        raise PolicyError(e.message) from e
    return policy_from_data(data, path)


def _describe(error: ValidationError, prefix: str = "") -> str:
    return "; ".join(f"{prefix}{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}"
                     for err in error.errors())
