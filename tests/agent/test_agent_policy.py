"""The health policy as data: the XID table, the thresholds, and a site's override file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainyard_agent.health.policy import HealthPolicy, PolicyError, default_policy, load_policy
from trainyard_agent.health.xid_catalog import APPLICATION_XIDS, XID_CATALOG
from trainyard_agent.model import Action, Health, HealthCounters

POLICY = default_policy()


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_application_xids_leave_the_gpu_healthy(xid: int) -> None:
    verdict = POLICY.xid(xid)
    assert (verdict.health, verdict.action) == (Health.HEALTHY, Action.IGNORE)
    assert "application error" in verdict.reason


@pytest.mark.parametrize("xid,health,action", [
    (79, Health.UNHEALTHY, Action.REBOOT_HOST),
    (143, Health.UNHEALTHY, Action.REBOOT_HOST),
    (64, Health.UNHEALTHY, Action.DRAIN_NODE),
    (54, Health.UNHEALTHY, Action.DRAIN_NODE),
    (48, Health.UNHEALTHY, Action.RESET_GPU),
    (74, Health.UNHEALTHY, Action.RESET_GPU),
    (95, Health.UNHEALTHY, Action.RESET_GPU),
    (119, Health.UNHEALTHY, Action.RESET_GPU),
    (63, Health.DEGRADED, Action.RESTART_JOB),
    (94, Health.DEGRADED, Action.RESTART_JOB),
    (92, Health.DEGRADED, Action.IGNORE),
    (116, Health.HEALTHY, Action.IGNORE),  # a display error: training does not use the display engine
    (12345, Health.DEGRADED, Action.RESTART_JOB),  # not in the catalog
])
def test_hardware_xids(xid: int, health: Health, action: Action) -> None:
    verdict = POLICY.xid(xid)
    assert (verdict.health, verdict.action) == (health, action)
    assert verdict.reason.startswith(f"XID {xid}: ")


def test_xid_79_says_what_happened() -> None:
    assert POLICY.xid(79).reason == "XID 79: GPU has fallen off the bus"


def test_the_catalog_is_consistent() -> None:
    xids = [row[0] for row in XID_CATALOG]
    assert xids == sorted(set(xids)), "one row per XID, in order"
    assert len(xids) > 120
    for xid, action, health, description in XID_CATALOG:
        assert description and description == description.strip(), xid
        assert health is not Health.HEALTHY or action is Action.IGNORE, xid
        assert not action.drains_node or health is Health.UNHEALTHY, xid
    assert all(POLICY.xid(x).health is Health.HEALTHY for x in APPLICATION_XIDS)
    drains = sorted(x for x, action, _, _ in XID_CATALOG if action.drains_node)
    assert drains == [54, 58, 64, 79, 143, 157, 161]


def test_a_lost_gpu_asks_for_what_xid_79_asks_for() -> None:
    verdict = POLICY.lost("NVML error NVMLError_GpuIsLost: GPU is lost")
    assert (verdict.health, verdict.action) == (Health.UNHEALTHY, Action.REBOOT_HOST)
    assert "GpuIsLost" in verdict.reason


@pytest.mark.parametrize("counters,source,expected", [
    (HealthCounters(), "ecc", None),
    (HealthCounters(ecc_volatile_uncorrected=1), "ecc", (Health.DEGRADED, Action.RESTART_JOB)),
    (HealthCounters(ecc_volatile_uncorrected=10), "ecc", (Health.UNHEALTHY, Action.RESET_GPU)),
    # corrected and lifetime counts are reported, not judged
    (HealthCounters(ecc_volatile_corrected=10_000, ecc_aggregate_uncorrected=50), "ecc", None),
    (HealthCounters(remapped_rows_pending=True), "memory", (Health.DEGRADED, Action.RESET_GPU)),
    (HealthCounters(remapped_rows_failure=True), "memory", (Health.UNHEALTHY, Action.DRAIN_NODE)),
    (HealthCounters(retired_pages=59), "memory", None),
    (HealthCounters(retired_pages=60), "memory", (Health.UNHEALTHY, Action.DRAIN_NODE)),
    (HealthCounters(retired_pages_pending=True), "memory", (Health.DEGRADED, Action.RESET_GPU)),
    # off by default: a few NVLink CRC errors and PCIe replays are retried by the link and normal
    (HealthCounters(nvlink_errors=10**6, pcie_replays=10**6), "nvlink", None),
])
def test_counter_thresholds(counters: HealthCounters, source: str,
                            expected: tuple[Health, Action] | None) -> None:
    verdict = POLICY.counters(counters)[source]
    assert (None if verdict is None else (verdict.health, verdict.action)) == expected


def test_memory_findings_are_combined_worst_first() -> None:
    verdict = POLICY.counters(HealthCounters(remapped_rows_pending=True, remapped_rows_failure=True))["memory"]
    assert verdict is not None and (verdict.health, verdict.action) == (Health.UNHEALTHY, Action.DRAIN_NODE)
    assert verdict.reason == "row remapping failed: the GPU needs replacing; a row remapping waits for a GPU reset"


def test_temperature_and_throttling_with_hysteresis() -> None:
    assert POLICY.thermal(80, (), flagged=False) is None
    hot = POLICY.thermal(88, ("sw_thermal",), flagged=False)
    assert hot is not None and (hot.health, hot.action) == (Health.DEGRADED, Action.IGNORE)
    assert hot.reason == "thermal slowdown at 88 °C (limit 87 °C)"
    # cooling down: still degraded just under the limit, healthy 3 °C below it
    assert POLICY.thermal(86, (), flagged=True) is not None
    assert POLICY.thermal(84, (), flagged=True) is None
    braked = POLICY.thermal(60, ("hw_power_brake", "sw_power_cap"), flagged=False)
    assert braked is not None and braked.reason == "clocks throttled by hw_power_brake"
    assert POLICY.thermal(60, ("sw_power_cap", "applications_clocks"), flagged=False) is None


# --- the site's file ----------------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_site_file_overrides_rows_and_thresholds(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, """
xids:
  79: {action: drain_node}
  48: {action: reset_gpu, health: unhealthy, description: double-bit ECC (site rule)}
  200: {action: restart_job}
  13: {action: restart_job}
unknown_xid: {action: ignore, health: degraded}
thresholds:
  ecc_uncorrected_unhealthy_at: 4
  temperature_degraded_c: 80
  nvlink_errors_degraded_at: 100
"""))
    assert isinstance(policy, HealthPolicy)
    assert (policy.xid(79).action, policy.xid(79).health, policy.xid(79).reason) == (
        Action.DRAIN_NODE, Health.UNHEALTHY, "XID 79: GPU has fallen off the bus")
    assert policy.xid(48).reason == "XID 48: double-bit ECC (site rule)"
    assert (policy.xid(200).health, policy.xid(200).action) == (Health.DEGRADED, Action.RESTART_JOB)
    assert policy.xid(200).reason == "XID 200: site rule for XID 200"
    assert (policy.xid(13).health, policy.xid(13).action) == (Health.DEGRADED, Action.RESTART_JOB)
    assert (policy.xid(777).health, policy.xid(777).action) == (Health.DEGRADED, Action.IGNORE)
    assert policy.lost("x").action is Action.DRAIN_NODE  # follows XID 79's row
    ecc = policy.counters(HealthCounters(ecc_volatile_uncorrected=4))["ecc"]
    assert ecc is not None and ecc.health is Health.UNHEALTHY
    assert policy.thermal(81, (), flagged=False) is not None
    assert policy.counters(HealthCounters(nvlink_errors=100))["nvlink"] is not None
    assert policy.thresholds.ecc_uncorrected_degraded_at == 1  # the rest keeps its default
    # The default policy is untouched.
    assert POLICY.xid(79).action is Action.REBOOT_HOST


def test_a_json_site_file_and_an_empty_one(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, json.dumps({"xids": {"74": {"action": "drain_node"}}}), "p.json"))
    assert policy.xid(74).action is Action.DRAIN_NODE
    assert load_policy(write(tmp_path, "")).xid(74).action is Action.RESET_GPU
    assert load_policy("").xid(74).action is Action.RESET_GPU


@pytest.mark.parametrize("text,message", [
    ("xids:\n  79: {action: explode}\n",
     "xids.79.action: Input should be 'ignore', 'restart_job', 'reset_gpu', 'drain_node' or 'reboot_host'"),
    ("xids:\n  79: {action: drain_node, health: sick}\n", "xids.79.health: Input should be 'healthy', 'degraded'"),
    ("xids:\n  79: {action: drain_node, severity: 3}\n", "xids.79.severity: Extra inputs are not permitted"),
    ("xids:\n  abc: {action: ignore}\n", "xids.abc.[key]: Input should be a valid integer"),
    ("xids:\n  0: {action: ignore}\n", "xids.0: an XID is a number from 1 to 999"),
    ("xids:\n  13: {action: drain_node}\n", "xids.13: XID 13 is an application error (the user's program"),
    ("xids:\n  13: {action: reset_gpu, health: unhealthy}\n", "xids.13: XID 13 is an application error"),
    ("xids:\n  31: {action: restart_job, health: unhealthy}\n", "xids.31: XID 31 is an application error"),
    ("xids:\n  48: {action: reset_gpu, health: healthy}\n",
     "xids.48: health healthy with action reset_gpu contradicts itself"),
    ("xids:\n  48: {action: drain_node, health: degraded}\n", "xids.48: action drain_node needs health unhealthy"),
    ("unknown_xid: {action: reboot_host, health: degraded}\n", "unknown_xid: action reboot_host needs health"),
    ("thresholds: {ecc_unhealthy: 3}\n", "thresholds.ecc_unhealthy: Extra inputs are not permitted"),
    ("thresholds: {ecc_uncorrected_unhealthy_at: -1}\n",
     "thresholds.ecc_uncorrected_unhealthy_at: Input should be greater than or equal to 0"),
    ("thresholds: {ecc_uncorrected_degraded_at: 5, ecc_uncorrected_unhealthy_at: 2}\n",
     "ecc_uncorrected_degraded_at (5) must not be above ecc_uncorrected_unhealthy_at (2)"),
    ("thresholds: {throttle_reasons_degraded: [hw_thermal, too_hot]}\n", "unknown throttle reason(s) too_hot"),
    ("thresholds: {temperature_degraded_c: 400}\n", "temperature_degraded_c: Input should be less than or equal"),
    ("rules: {}\n", "rules: Extra inputs are not permitted"),
    ("- 79\n", "must hold a mapping with xids, unknown_xid and/or thresholds"),
    ("xids: {79: {action: drain_node}\n", "is not valid YAML/JSON"),
])
def test_bad_site_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert message in info.value.message and path in info.value.message


def test_a_missing_site_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"cannot read health policy file .*missing\.yaml: No such file"):
        load_policy(str(tmp_path / "missing.yaml"))
