"""The scheduler's policy settings, as an operator writes them in a YAML file (the README's example)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_core.settings import SettingsError, load_settings
from trainyard_scheduler.settings import SchedulerSettings

README_EXAMPLE = """
speed_factors: {H100-80GB-HBM3: 3.0, A100-SXM4-80GB: 1.0, Instinct-MI300X: 2.5}
priority_classes:
  low: {value: -100, can_preempt: false}
  normal: {value: 0}
  high: {value: 100}
  critical: {value: 1000, preemptible: false}
default_priority_class: normal
fair_share_half_life_s: 3600
reservation_depth: 1
preemption: true
preempt_exempt_s: 300
placement_order: fair-share
"""


def _load(tmp_path: Path, text: str, *argv: str) -> SchedulerSettings:
    path = tmp_path / "scheduler.yaml"
    path.write_text(text)
    return load_settings(SchedulerSettings, prog="trainyard-scheduler", env_prefix="TRAINYARD_SCHEDULER_",
                         argv=["--config", str(path), *argv])


def test_the_readme_example_loads_into_the_policy(tmp_path: Path) -> None:
    policy = _load(tmp_path, README_EXAMPLE).policy()
    assert policy.speed("H100-80GB-HBM3", {}) == 3.0 and policy.speed("unknown", {}) == 1.0
    assert policy.priority_class("").name == "normal"
    assert not policy.priority_class("low").can_preempt and not policy.priority_class("critical").preemptible
    assert policy.reservation_depth == 1 and policy.preemption
    assert policy.exempt_until(100.0, 2) == 100.0 + 1200.0


def test_speed_factor_flags_override(tmp_path: Path) -> None:
    s = _load(tmp_path, README_EXAMPLE, "--speed-factors", "L40S=0.5")
    assert s.speed_factors == {"L40S": 0.5}


@pytest.mark.parametrize(("text", "message"), [
    ("default_priority_class: urgent\n", "default priority class 'urgent' is not one of"),
    ("speed_factors: {H100: 0}\n", "speed factors must be > 0"),
    ("reservation_depth: -1\n", "reservation_depth"),
    ("placement_order: random\n", "placement_order"),
    ("priority_classes: {normal: {value: lots}}\n", "priority_classes.normal.value"),
    ("node_timeout_s: 6\nworker_fence_s: 8\n", "worker_fence_s (8.0) must be at least node_timeout_s + leader_ttl_s"),
    ("node_timeout_s: 1\nheartbeat_interval_ms: 500\n", "must be at least 3 heartbeat intervals"),
    ("max_infra_restarts: -1\n", "max_infra_restarts"),
])
def test_bad_policy_settings_are_refused_clearly(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        _load(tmp_path, text)
    assert message in str(info.value)
