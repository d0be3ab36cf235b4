"""Bad input is refused by the gateway with 400, a message naming the field, and no call to the
scheduler (so nothing can change in etcd). One real scheduler (no nodes) and one gateway serve the whole
module: every test here only reads what the gateway answers and what the scheduler was asked."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd_secure import fresh_prefix, settings_of

from .support import CallLog, Cluster, RunningGateway, running_cluster, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

GOOD: dict[str, Any] = {"name": "train-1", "command": ["python", "train.py"], "env": {"LR": "0.1"},
                        "resources": {"nodes": 2, "gpus_per_node": 1}}


MODULE_PREFIX = fresh_prefix().rstrip("/")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scheduler(etcd_options: EtcdOptions, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    async with running_cluster(etcd=settings_of(etcd_options), prefix=f"{MODULE_PREFIX}/scheduler",
                               state_root=tmp_path_factory.mktemp("nodes")) as cluster:
        yield cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live_gateway(etcd_options: EtcdOptions, scheduler: Cluster) -> AsyncIterator[RunningGateway]:
    async with running_gateway(etcd=settings_of(etcd_options), etcd_prefix=MODULE_PREFIX,
                               scheduler_address=scheduler.address) as gw:
        yield gw


@pytest.fixture
def calls(scheduler: Cluster) -> CallLog:
    """What the scheduler is asked during this test."""
    scheduler.calls.clear()
    return scheduler.calls


def _with(**changes: Any) -> dict[str, Any]:
    body = {**GOOD, "resources": dict(GOOD["resources"])}
    for key, value in changes.items():
        if key.startswith("resources__"):
            body["resources"][key.removeprefix("resources__")] = value
        else:
            body[key] = value
    return body


def _assert_error(reply: Any, field: str, status: int = 400) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == "invalid_argument"
    message = str(body["error"]["message"])
    assert field in message, message
    return message


@pytest.mark.parametrize(("body", "field"), [
    (_with(resources__nodes=0), "resources.nodes"),
    (_with(resources__nodes=-2), "resources.nodes"),
    (_with(resources__gpus_per_node=65), "resources.gpus_per_node"),  # 0 is a CPU task
    (_with(resources__nodes=4097), "resources.nodes"),
    (_with(priority=1001), "priority"),
    (_with(priority=-1001), "priority"),
    (_with(max_restarts=101), "max_restarts"),
    (_with(priority="1"), "priority"),  # strict: no string → int
    (_with(resources__nodes=2.5), "resources.nodes"),
    (_with(resources__gpus_per_node=-1), "resources.gpus_per_node"),
    (_with(resources__gpus_per_node="2"), "resources.gpus_per_node"),  # strict: no string → int
    (_with(resources__nodes=True), "resources.nodes"),
    (_with(resources__nodes=1.5), "resources.nodes"),
    (_with(resources__nodes=2**40), "resources.nodes"),
    (_with(resources__cpus=4), "resources.cpus"),
    (_with(gpus=8), "gpus"),
    (_with(name=""), "name"),
    (_with(name="Train"), "name"),
    (_with(name="my job"), "name"),
    (_with(name="-leading-dash"), "name"),
    (_with(name="x" * 64), "name"),
    (_with(name=7), "name"),
    (_with(command=[]), "command"),
    (_with(command="python train.py"), "command"),
    (_with(command=["", "x"]), "command"),
    (_with(env={"1BAD": "x"}), "env"),
    (_with(env={"OK": 1}), "env.OK"),
    (_with(env={"RANK": "3"}), "env"),
    (_with(env={"TRAINYARD_JOB_ID": "x"}), "env"),
    (_with(env={f"V{i}": "x" for i in range(257)}), "env"),
    (_with(env={"K" * 129: "x"}), "env"),
    (_with(command=[" python"]), "command"),
    (_with(command=["python", "a\0b"]), "command[1]"),
    (_with(command=["x" * 32769]), "command[0]"),
    (_with(command=["python"] + ["x" * 32768] * 5), "command"),  # 131072 characters together at most
    (_with(labels={"bad key!": "v"}), "labels"),
    (_with(labels={"k": "v" * 254}), "labels.k"),
    (_with(resources__accelerator="H100 80GB"), "resources.accelerator"),
    (_with(resources__accelerator="H100", resources__accelerators=["A100"]), "resources"),
    (_with(resources__accelerators=["A100", "A100"]), "resources.accelerators"),
    (_with(resources__gpus_per_node=0, resources__vendor="nvidia"), "resources"),
    (_with(topology={"required": True}), "topology"),
    (_with(topology={"wait_s": 60}), "topology"),
    (_with(topology={"tier": "leaf", "required": True, "wait_s": 60}), "topology"),
    (_with(priority_class="no such!"), "priority_class"),
    (_with(working_dir="relative/dir"), "working_dir"),
    (_with(max_restarts=-1), "max_restarts"),
    (_with(queue="Not A Queue"), "queue"),
    (_with(resources__accelerators=["a"] * 17), "resources.accelerators"),
    (_with(resources__accelerators="H100,A100"), "resources.accelerators"),
    (_with(resources__min_memory_gb=4097), "resources.min_memory_gb"),
    (_with(resources__min_compute_capability="9"), "resources.min_compute_capability"),
    (_with(resources__vendor="v" * 33), "resources.vendor"),
    (_with(resources__allow_mixed="yes"), "resources.allow_mixed"),
    (_with(resources__cpus_per_node=-1), "resources.cpus_per_node"),
    (_with(resources__speed_hints={"H100": 0}), "resources.speed_hints.H100"),
    (_with(resources__speed_hints={"H100": "fast"}), "resources.speed_hints.H100"),
    (_with(resources__speed_hints={"": 1.0}), "resources.speed_hints"),
    (_with(topology={"tier": "island"}), "topology.tier"),
    (_with(topology={"tier": "leaf", "wait_s": 7 * 86400 + 1}), "topology.wait_s"),
    (_with(topology={"tier": "leaf", "required": 1}), "topology.required"),
    (_with(topology={"tier": "leaf", "switches": 1}), "topology.switches: unknown field"),
    (_with(preemption={"signal": "SIGKILL"}), "preemption.signal"),
    (_with(preemption={"grace_s": -1}), "preemption.grace_s"),
    (_with(restart_backoff_s=3601), "restart_backoff_s"),
    (_with(time_limit_s="1h"), "time_limit_s"),
    (_with(time_limit_s=365 * 86400 + 1), "time_limit_s"),
    (_with(checkpoint={"keep_last": -1}), "checkpoint.keep_last"),
    (_with(checkpoint={"every_steps": "often"}), "checkpoint.every_steps"),
    (_with(checkpoint={"interval_s": 8 * 86400}), "checkpoint.interval_s"),
    (_with(priority_class="x" * 64), "priority_class"),
    ({k: v for k, v in GOOD.items() if k != "resources"}, "resources"),
    ({k: v for k, v in GOOD.items() if k != "command"}, "command"),
])
async def test_bad_job_specs(live_gateway: RunningGateway, calls: CallLog,
                             body: dict[str, Any], field: str) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.post("/v1/jobs", json=body)
    _assert_error(reply, field)
    assert calls.calls == []


async def test_every_problem_is_named(live_gateway: RunningGateway) -> None:
    body = _with(name="Bad", resources__nodes=0, extra_field=1)
    async with live_gateway.client(live_gateway.admin_token) as http:
        message = _assert_error(await http.post("/v1/jobs", json=body), "name")
    assert "resources.nodes" in message and "extra_field: unknown field" in message
    assert "(got 0)" in message


@pytest.mark.parametrize(("content", "headers", "expected"), [
    (b'{"name": "x", ', {"Content-Type": "application/json"}, "not valid JSON"),
    (b"[1, 2]", {"Content-Type": "application/json"}, "request body"),
    (b"", {"Content-Type": "application/json"}, "request body is required"),
    (b"name=x", {"Content-Type": "application/x-www-form-urlencoded"}, "Content-Type: application/json"),
])
async def test_malformed_bodies(live_gateway: RunningGateway, calls: CallLog, content: bytes,
                                headers: dict[str, str], expected: str) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.post("/v1/jobs", content=content, headers=headers)
    _assert_error(reply, expected)
    assert calls.calls == []


async def test_a_valid_spec_reaches_the_scheduler(live_gateway: RunningGateway, calls: CallLog) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.post("/v1/jobs", json=GOOD)
    assert reply.status_code == 201, reply.text
    assert calls.methods == ["SubmitJobs"] and len(calls.submits()) == 1


@pytest.mark.parametrize(("query", "field"), [
    ("page_size=0", "page_size"),
    ("page_size=-5", "page_size"),
    ("page_size=100000", "page_size"),
    ("page_size=ten", "page_size"),
    ("state=bogus", "state"),
    ("page_token=" + "x" * 2000, "page_token"),
    ("label=project", "label"),
    ("label=bad%20key=x", "label"),
    ("user=a%20b", "user"),
    ("team=Vision", "team"),
    ("queue=Q!", "queue"),
    ("name_prefix=" + "x" * 64, "name_prefix"),
    ("submitted_after=2026-01-01T00:00:00", "submitted_after"),
    ("finished_before=yesterday", "finished_before"),
])
async def test_list_parameters(live_gateway: RunningGateway, calls: CallLog, query: str,
                               field: str) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.get("/v1/jobs?" + query)
    _assert_error(reply, field)
    assert calls.calls == []


@pytest.mark.parametrize(("method", "path", "field"), [
    ("GET", "/v1/jobs/NOT_AN_ID", "job_id"),
    ("GET", "/v1/jobs/ab", "job_id"),
    ("POST", "/v1/jobs/Job_X:cancel", "job_id"),
    ("GET", "/v1/jobs?page_token=not.a.token", "page_token"),
    ("GET", "/v1/jobs/job-abc/logs?attempt=2147483648", "attempt"),
    ("GET", "/v1/jobs/job-abc/logs?tail=-1", "tail"),
    ("GET", "/v1/jobs/job-abc/logs?attempt=-1", "attempt"),
])
async def test_path_and_query_checks(live_gateway: RunningGateway, calls: CallLog, method: str,
                                     path: str, field: str) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.request(method, path)
    _assert_error(reply, field)
    assert calls.calls == []


@pytest.mark.parametrize("key", ["k" * 129, "with space", "semi;colon"])
async def test_idempotency_key_follows_the_schedulers_rule(live_gateway: RunningGateway, calls: CallLog,
                                                           key: str) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.post("/v1/jobs", json=GOOD, headers={"Idempotency-Key": key})
    _assert_error(reply, "Idempotency-Key")
    assert calls.calls == []


@pytest.mark.parametrize("body", [
    # JSON Schema's integer is any number without a fraction: 2.0 is one, and so reaches the scheduler as 2.
    _with(resources__nodes=2.0, max_restarts=3.0),
    # The boundaries the schema states are the scheduler's own: both take them.
    _with(resources__nodes=4096, resources__gpus_per_node=64, priority=1000, max_restarts=100),
    _with(priority=-1000, env={f"V{i}": "x" * 32768 for i in range(4)}, labels={"k" * 63: "v" * 253}),
    _with(command=["python"] + ["x" * 32768] * 3 + ["x" * (32768 - 6)]),  # exactly 131072 characters
    _with(resources__gpus_per_node=0, resources__cpus_per_node=4096),
    _with(topology={"tier": "leaf", "required": True}, queue="", priority_class=""),
])
async def test_what_the_schema_calls_valid_reaches_the_scheduler(live_gateway: RunningGateway, calls: CallLog,
                                                                 body: dict[str, Any]) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.post("/v1/jobs", json=body)
    # Never 400: the scheduler has no nodes, so what passed its validation waits (201), unless its settings
    # cannot hold it (409 failed_precondition: 4096 nodes is more than one etcd transaction takes here).
    assert calls.methods == ["SubmitJobs"] and len(calls.submits()) == 1
    if reply.status_code == 409:
        assert reply.json()["error"]["code"] == "failed_precondition", reply.text
        return
    assert reply.status_code == 201, reply.text
    assert reply.json()["spec"]["max_restarts"] == body.get("max_restarts", 0)
