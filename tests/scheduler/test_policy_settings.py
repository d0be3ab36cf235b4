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
    ("node_timeout_s: 1\n", "node_timeout_s (1.0) must be more than two liveness pulse intervals"),
    ("max_infra_restarts: -1\n", "max_infra_restarts"),
])
def test_bad_policy_settings_are_refused_clearly(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        _load(tmp_path, text)
    assert message in str(info.value)


def test_priority_classes_as_repeatable_flags(tmp_path: Path) -> None:
    """`--priority-classes low=5` failed with "Input should be a valid dictionary": each flag is one class,
    NAME=VALUE[,preemptible=BOOL][,can_preempt=BOOL], and the flags replace the file's whole table."""
    s = _load(tmp_path, README_EXAMPLE, "--priority-classes", "low=5", "--priority-classes",
              "normal=0,can_preempt=false", "--priority-classes", "vip=value=500,preemptible=no")
    assert set(s.priority_classes) == {"low", "normal", "vip"}
    policy = s.policy()
    assert policy.priority_class("low").value == 5 and policy.priority_class("low").can_preempt
    assert not policy.priority_class("normal").can_preempt and not policy.priority_class("vip").preemptible


def test_priority_classes_in_the_environment(tmp_path: Path) -> None:
    s = load_settings(SchedulerSettings, prog="trainyard-scheduler", env={
        "TRAINYARD_SCHEDULER_PRIORITY_CLASSES": "low=-100,can_preempt=false; normal=0 ;critical=1000,preemptible=no"})
    assert {n: (c.value, c.preemptible, c.can_preempt) for n, c in s.priority_classes.items()} == {
        "low": (-100, True, False), "normal": (0, True, True), "critical": (1000, False, True)}


@pytest.mark.parametrize(("argv", "message"), [
    (["--priority-classes", "low"], "priority_classes expects NAME=VALUE[,preemptible=...][,can_preempt=...]"),
    (["--priority-classes", "normal=0,preemptable=false"], "unknown field 'preemptable'"),
    (["--priority-classes", "normal=zero"], "priority_classes.normal.value"),
    (["--priority-classes", "normal=0,can_preempt=maybe"], "priority_classes.normal.can_preempt"),
    # The flags replace the table, so the default class must be among them.
    (["--priority-classes", "high=100"], "default priority class 'normal' is not one of"),
])
def test_bad_priority_class_flags_are_named(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        _load(tmp_path, "", *argv)
    assert message in info.value.message


def test_a_misspelt_priority_class_field_in_the_file_is_refused(tmp_path: Path) -> None:
    """It was dropped silently: a class meant never to be preempted was preemptible."""
    with pytest.raises(SettingsError, match=r"priority_classes\.critical\.premptible: Extra inputs"):
        _load(tmp_path, "priority_classes:\n  normal: {value: 0}\n  critical: {value: 1000, premptible: false}\n")


def test_an_unknown_scheduler_variable_is_refused() -> None:
    with pytest.raises(SettingsError, match=r"TRAINYARD_SCHEDULER_PRIORITY_CLASS is no setting.*"
                                            r"TRAINYARD_SCHEDULER_PRIORITY_CLASSES"):
        load_settings(SchedulerSettings, prog="trainyard-scheduler",
                      env={"TRAINYARD_SCHEDULER_PRIORITY_CLASS": "low=1"})
