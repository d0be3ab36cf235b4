"""GPU health reported by agents: what it does to the node and to the gangs on it (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainyard_scheduler.domain.health import apply_gpu_health
from trainyard_scheduler.domain.models import Allocation, Gpu, JobState, NodeAssignment
from trainyard_scheduler.domain.progress import progress

from .builders import NOW, make_job, make_node


def sick(index: int, action: str, reason: str = "XID 79: GPU has fallen off the bus") -> Gpu:
    return Gpu(index=index, uuid=f"u{index}", vendor="nvidia", model="H100", memory_mb=80_000, healthy=False,
               health_reason=reason, health_action=action)


@pytest.mark.parametrize(("action", "cordoned"), [
    ("drain_node", True), ("reboot_host", True), ("restart_job", False), ("reset_gpu", False),
])
def test_only_node_level_actions_cordon(action: str, cordoned: bool) -> None:
    node = apply_gpu_health(make_node("n-a"), {3: sick(3, action)})
    assert node.unhealthy_gpus() == {3}
    assert node.cordoned is cordoned
    if cordoned:
        assert "GPU 3" in node.cordon_reason and action in node.cordon_reason


def test_application_class_xid_changes_nothing() -> None:
    healthy = Gpu(index=3, uuid="u3", vendor="nvidia", model="H100", memory_mb=80_000, healthy=True,
                  health_reason="XID 13 (application error, ignored)", health_action="none")
    node = apply_gpu_health(make_node("n-a"), {3: healthy})
    assert not node.cordoned and node.unhealthy_gpus() == frozenset()


def test_operator_cordon_reason_is_kept() -> None:
    node = replace(make_node("n-a"), cordoned=True, cordon_reason="maintenance window")
    assert apply_gpu_health(node, {3: sick(3, "drain_node")}).cordon_reason == "maintenance window"


def test_unknown_gpu_index_is_ignored() -> None:
    node = make_node("n-a", gpus=2)
    assert apply_gpu_health(node, {7: sick(7, "drain_node")}) == node


ALLOC = Allocation(job_id="job-1", attempt=1, master_addr="n-a", master_port=29500, created_at=NOW,
                   assignments=(NodeAssignment("n-a", 0, (2, 3), (0, 1)),), launched=frozenset({"n-a"}))


def test_gang_on_an_unhealthy_gpu_is_stopped() -> None:
    node = apply_gpu_health(make_node("n-a"), {3: sick(3, "restart_job")})
    step = progress(make_job(state=JobState.RUNNING), ALLOC, frozenset({"n-a"}), NOW, {"n-a": node})
    assert step.alloc is not None and "GPU 3 on n-a became unhealthy: XID 79" in step.alloc.stop_reason
    assert step.stop == ("n-a",)


def test_gang_on_other_gpus_keeps_running() -> None:
    node = apply_gpu_health(make_node("n-a"), {5: sick(5, "drain_node")})
    step = progress(make_job(state=JobState.RUNNING), ALLOC, frozenset({"n-a"}), NOW, {"n-a": node})
    assert not step.writes and step.stop == ()
