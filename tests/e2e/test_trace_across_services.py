"""One job submission is one trace across the local cluster's real processes (mTLS on, as in production): the
gateway's HTTP span, the scheduler's SubmitJob, the later cycle's decision, commit and launch of the gang, the
agent's LaunchWorkers and launch; and the trace id is on the services' log lines about the job. A checkpoint
read is one trace from the gateway to the checkpoint-store, and a job's checkpoint saves join its trace.

Each service appends its spans to a file of its own (the trace_exporter setting, LocalCluster's trace_dir);
the test assembles them by trace id, and reads the services' JSON log lines from their log files."""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainyard_cli.local import LocalCluster
from trainyard_core import telemetry

from .conftest import Api, local_cluster

pytestmark = pytest.mark.e2e

SUBMIT = "/trainyard.scheduler.v1.JobService/SubmitJob"
LAUNCH = "/trainyard.agent.v1.AgentService/LaunchWorkers"
CHECKPOINTS = "/trainyard.checkpoint.v1.CheckpointService/ListCheckpoints"
BEGIN = "/trainyard.checkpoint.v1.CheckpointService/BeginCheckpoint"
COMMIT = "/trainyard.checkpoint.v1.CheckpointService/CommitCheckpoint"

Span = dict[str, Any]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory, "traced", log_format="json", nodes=(("node-1", "h100x8"),),
                       trace_dir=tmp_path_factory.mktemp("spans")) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[Api]:
    a = Api(cluster)
    a.wait_nodes_ready(1)
    yield a
    a.http.close()


def _caller() -> tuple[str, str]:
    """A client's W3C context (sampled): the trace id the test looks for, and the header that carries it."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, f"00-{trace_id}-{span_id}-01"


def _hex(value: str | None) -> str:
    return (value or "").removeprefix("0x")


def _spans(cluster: LocalCluster, trace_id: str) -> list[Span]:
    assert cluster.trace_dir is not None
    found = []
    for path in sorted(cluster.trace_dir.glob("*.spans.jsonl")):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            if _hex(span["context"]["trace_id"]) == trace_id:
                found.append(span)
    return found


def _service(span: Span) -> str:
    return str(span["resource"]["attributes"]["service.name"])


def _named(spans: list[Span], service: str, name: str) -> list[Span]:
    return [s for s in spans if _service(s) == service and s["name"] == name]


def _trace(cluster: LocalCluster, traceparent: str, wanted: list[tuple[str, str]],
           timeout: float = 30.0) -> list[Span]:
    """The spans of the trace `traceparent` began, once every (service, name) in `wanted` is there and each
    span's parent is in it too, or is the caller's (the services export in batches, every few seconds)."""
    _, trace_id, caller, _ = traceparent.split("-")
    deadline = time.monotonic() + timeout
    spans: list[Span] = []
    orphans: list[Span] = []
    while time.monotonic() < deadline:
        spans = _spans(cluster, trace_id)
        ids = {_hex(s["context"]["span_id"]) for s in spans} | {caller}
        orphans = [s for s in spans if _hex(s["parent_id"]) not in ids]
        if all(_named(spans, service, name) for service, name in wanted) and not orphans:
            return spans
        time.sleep(0.2)
    have = sorted({(_service(s), s["name"]) for s in spans})
    raise AssertionError(f"trace {trace_id} after {timeout}s: lacks {sorted(set(wanted) - set(have))}, has {have}; "
                         f"spans whose parent is not in it: {[(_service(s), s['name']) for s in orphans]}")


def _parent(spans: list[Span], span: Span) -> Span:
    [parent] = [s for s in spans if _hex(s["context"]["span_id"]) == _hex(span["parent_id"])]
    return parent


def _ancestors(spans: list[Span], span: Span) -> list[Span]:
    chain = []
    by_id = {_hex(s["context"]["span_id"]): s for s in spans}
    while _hex(span["parent_id"]) in by_id:
        span = by_id[_hex(span["parent_id"])]
        chain.append(span)
    return chain


def _log_lines(cluster: LocalCluster, name: str) -> list[dict[str, Any]]:
    lines = []
    for text in (cluster.workdir / "logs" / f"{name}.log").read_text().splitlines():
        if text.startswith("{"):
            lines.append(json.loads(text))
    return lines


def test_a_submission_is_one_trace_from_the_gateway_through_the_scheduler_to_the_agent(
        cluster: LocalCluster, api: Api) -> None:
    trace_id, traceparent = _caller()
    reply = api.http.post("/v1/jobs", headers={"traceparent": traceparent},
                          json={"name": "traced", "command": [sys.executable, "-c", "print('ok')"],
                                "resources": {"nodes": 1, "gpus_per_node": 1}})
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    api.wait(job_id, {"succeeded"})

    spans = _trace(cluster, traceparent, [("gateway", "POST /v1/jobs"), ("scheduler", SUBMIT),
                                       ("scheduler", "reconcile.decide"), ("scheduler", "reconcile.commit"),
                                       ("scheduler", "reconcile.launch"), ("agent", LAUNCH),
                                       ("agent", "supervisor.launch")])
    [http] = _named(spans, "gateway", "POST /v1/jobs")
    assert http["kind"] == "SpanKind.SERVER" and _hex(http["parent_id"]) == traceparent.split("-")[2]
    assert http["attributes"]["http.route"] == "/v1/jobs" and http["attributes"]["http.response.status_code"] == 201
    # The scheduler's side of the submit is the gateway request's, through the gRPC call.
    [submit] = _named(spans, "scheduler", SUBMIT)
    assert http in _ancestors(spans, submit)
    assert submit["attributes"][telemetry.JOB_ID] == job_id
    # The cycle placed the job later, in spans of the submit's trace, children of the submit's span.
    [decide] = _named(spans, "scheduler", "reconcile.decide")
    [commit] = _named(spans, "scheduler", "reconcile.commit")
    [launch] = _named(spans, "scheduler", "reconcile.launch")
    for span in (decide, commit, launch):
        assert _parent(spans, span) is submit
        assert span["attributes"][telemetry.JOB_ID] == job_id
    assert commit["attributes"][telemetry.NODE_IDS] == ["node-1"]
    assert launch["attributes"][telemetry.NODE_ID] == "node-1"
    # The agent's side of the launch is the scheduler's launch, through the gRPC call.
    [served] = _named(spans, "agent", LAUNCH)
    [started] = _named(spans, "agent", "supervisor.launch")
    assert launch in _ancestors(spans, served) and _parent(spans, started) is served
    assert started["attributes"][telemetry.JOB_ID] == job_id and started["attributes"][telemetry.NODE_ID] == "node-1"

    # The trace id is on the services' log lines about the job.
    gateway = [line for line in _log_lines(cluster, "gateway") if line["msg"].startswith("POST /v1/jobs ")]
    assert any(line.get("trace_id") == trace_id for line in gateway), gateway
    scheduler = [line for line in _log_lines(cluster, "scheduler") if line.get("job_id") == job_id]
    said = {line["msg"] for line in scheduler if line.get("trace_id") == trace_id}
    assert {"job submitted", "gang placed", "workers launched"} <= said, scheduler
    cycle = [line for line in scheduler if line["logger"] in ("trainyard_scheduler.reconcile",
                                                              "trainyard_scheduler.placement_writes")]
    assert cycle and all(line.get("trace_id") == trace_id for line in cycle), cycle
    agent = [line for line in _log_lines(cluster, "node-1") if line.get("job_id") == job_id]
    assert any(line["msg"] == "workers started" and line.get("trace_id") == trace_id for line in agent), agent


def test_every_line_a_service_writes_names_a_trace(cluster: LocalCluster, api: Api) -> None:
    """Lines of no request and no job (start-up, TLS, leader election, the agent's registration) name the
    process's own trace, one per process; every other line names its request's or its job's."""
    for name in ("scheduler", "gateway", "checkpoint-store", "node-1"):
        lines = _log_lines(cluster, name)
        untraced = [line for line in lines if not line.get("trace_id")]
        assert lines and not untraced, (name, untraced[:5])
        [starting] = [line for line in lines if line["msg"] == "starting"]
        [mtls] = [line for line in lines if line["msg"] == "mTLS on"]
        assert mtls["trace_id"] == starting["trace_id"] and mtls["span_id"] == starting["span_id"], name
    [elected] = [line for line in _log_lines(cluster, "scheduler") if line["msg"] == "became leader"]
    [starting] = [line for line in _log_lines(cluster, "scheduler") if line["msg"] == "starting"]
    assert elected["trace_id"] == starting["trace_id"]


def test_a_checkpoint_read_is_one_trace_from_the_gateway_to_the_checkpoint_store(
        cluster: LocalCluster, api: Api) -> None:
    job = api.submit({"name": "listed", "command": [sys.executable, "-c", "pass"],
                      "resources": {"nodes": 1, "gpus_per_node": 1}})
    _, traceparent = _caller()
    reply = api.http.get(f"/v1/jobs/{job['id']}/checkpoints", headers={"traceparent": traceparent})
    assert reply.status_code == 200, reply.text
    spans = _trace(cluster, traceparent, [("gateway", "GET /v1/jobs/{job_id}/checkpoints"),
                                       ("checkpoint-store", CHECKPOINTS)])
    [http] = _named(spans, "gateway", "GET /v1/jobs/{job_id}/checkpoints")
    assert http["attributes"][telemetry.JOB_ID] == job["id"]
    [listed] = _named(spans, "checkpoint-store", CHECKPOINTS)
    assert http in _ancestors(spans, listed)
    api.wait(job["id"], {"succeeded"})



def test_a_jobs_checkpoint_saves_join_its_trace(cluster: LocalCluster, api: Api) -> None:
    """The worker's checkpoint client sends the job's trace (TRAINYARD_TRACEPARENT, set at launch) with its
    calls: the checkpoint-store's spans of the save are in the trace the submit began, under the submit."""
    _, traceparent = _caller()
    example = Path(__file__).resolve().parents[2] / "examples" / "train_with_checkpoints.py"
    reply = api.http.post("/v1/jobs", headers={"traceparent": traceparent},
                          json={"name": "traced-save", "command": [sys.executable, str(example), "--steps", "2",
                                                                   "--every", "2", "--sync"],
                                "resources": {"nodes": 1, "gpus_per_node": 1}})
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    done = api.wait(job_id, {"succeeded", "failed"}, timeout=120)
    assert done["state"] == "succeeded", done["message"]
    spans = _trace(cluster, traceparent, [("gateway", "POST /v1/jobs"), ("scheduler", SUBMIT),
                                       ("checkpoint-store", BEGIN), ("checkpoint-store", COMMIT)])
    [submit] = _named(spans, "scheduler", SUBMIT)
    for name in (BEGIN, COMMIT):
        [served] = _named(spans, "checkpoint-store", name)
        assert _parent(spans, served) is submit, name
