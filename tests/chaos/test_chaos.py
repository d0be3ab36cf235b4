"""The chaos suite: a random schedule of faults against a stream of real small jobs on a real local cluster
(3-member etcd, 2 scheduler replicas, checkpoint-store, gateway, 3 simulated GPU nodes), with the invariant
checker of invariants.py reading etcd, the agents and /proc throughout.

The cluster runs with every node and service on a host of its own (LocalCluster(control_plane_netns=True),
network namespaces: root) so the network faults can cut any of them from any other; without namespaces it
runs on loopback and the network kinds are left out of the plan, which is printed and in summary.json.

Phases: start the cluster → faults and jobs for CHAOS_DURATION_S → heal (restart what is down, SIGCONT what
is frozen, heal every link, mark GPUs healthy, uncordon nodes) → settle (no new jobs; wait, with a deadline,
for every job to end) → final checks → report. The seed is printed first and is in every failure message;
the plan it draws (schedule.py) is written to the run directory with the summary and every service's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainyard_cli.local import LocalCluster
from trainyard_core.errors import Unavailable
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing import netns
from trainyard_scheduler.settings import SchedulerSettings

from . import procs
from .conftest import ChaosSettings
from .faults import Faults
from .invariants import Checker
from .operations import Operator
from .schedule import FAULT_WEIGHTS, NETWORK_KINDS, Plan, make_plan
from .workload import MARKER, Workload

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

NODES = [("node-1", "h100x8"), ("node-2", "a100x4"), ("node-3", "a100x4")]
# Retention and GC run during the run (the defaults would wait 5 minutes for the first pass), so
# checkpoints are deleted by the service while others are committed and restored.
CHECKPOINT_STORE_ENV = {"TRAINYARD_CHECKPOINT_STORE_GC_INTERVAL_S": "5", "TRAINYARD_CHECKPOINT_STORE_GC_GRACE_S": "10"}
STRAY_DEADLINE_S = 30.0
# The scheduler's own defaults (the liveness deadlines the faults are drawn around), whatever they are now.
NODE_TIMEOUT_S = SchedulerSettings.model_fields["node_timeout_s"].default
HEARTBEAT_INTERVAL_MS = SchedulerSettings.model_fields["heartbeat_interval_ms"].default


class Reporter:
    """Lines that reach the terminal while the test runs, even with pytest's output capture on."""

    def __init__(self, capsys: pytest.CaptureFixture[str], log: Path) -> None:
        self.capsys = capsys
        self.log = log

    def __call__(self, line: str) -> None:
        with self.capsys.disabled():
            print(f"[chaos] {line}", flush=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")


async def test_invariants_hold_under_random_faults(chaos_settings: ChaosSettings, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    s = chaos_settings
    run_dir = tmp_path
    say = Reporter(capsys, run_dir / "chaos.log")
    say(f"seed {s.seed}, {s.duration_s:g}s of faults, settle deadline {s.settle_s:g}s; replay: {s.replay()}")
    say(f"run directory (service logs in cluster/logs/): {run_dir}")
    no_netns = netns.available()
    kinds = s.faults
    network_faults = "drawn: every node and service on a host of its own"
    if no_netns:
        left_out = sorted((kinds or frozenset(FAULT_WEIGHTS)) & NETWORK_KINDS)
        kinds = (kinds or frozenset(FAULT_WEIGHTS)) - NETWORK_KINDS
        network_faults = f"left out ({no_netns}): {', '.join(left_out) or 'none was asked for'}"
        say(f"network faults {network_faults}; the cluster runs on loopback")
    plan = make_plan(s.seed, s.duration_s, kinds=kinds)
    (run_dir / "plan.txt").write_text("\n".join(f.describe() for f in plan.faults) + "\n")
    say(f"plan: {len(plan.faults)} faults {dict(sorted(plan.fault_counts().items()))}")

    run_id = f"chaos-{s.seed}-{os.getpid()}"
    events = run_dir / "events"
    events.mkdir()
    cluster = LocalCluster(run_dir / "cluster", gateway_port=0, etcd_members=3, schedulers=2, stop_grace_s=2.0,
                           node_timeout_s=NODE_TIMEOUT_S, heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
                           log_format="text", nodes=NODES, control_plane_netns=not no_netns)
    started = time.monotonic()
    await asyncio.to_thread(cluster.start)
    try:
        store = EtcdStore.from_options(cluster.etcd_options(), timeout=2.0)  # as root: TLS, auth on
        http = httpx.AsyncClient(base_url=cluster.url, headers={"Authorization": f"Bearer {cluster.token}"},
                                 timeout=10)
        try:
            summary = await _run(s, plan, cluster, store, http, run_id, events, say)
        finally:
            await http.aclose()
            await store.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    summary["network_faults"] = network_faults
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    say(f"done in {summary['wall_s']}s: jobs {summary['jobs_by_state']}, faults {summary['faults_done']}")
    violations = summary["violations"]
    for stat, what in (("(a) allocation reads", "read of the allocations"), ("(a)(c) snapshot reads", "snapshot"),
                       ("(d) process scans", "process scan"), ("(d) agent listings", "agent listing")):
        if not summary["checks"].get(stat):
            violations.append(f"the checker never completed a single {what}: those invariants were not checked")
    if summary["checker_errors"]:
        violations.append("the checker itself failed (so some checks did not happen): "
                          + "; ".join(summary["checker_errors"][:5]))
    if violations:
        violations = [v + _log_lines(run_dir / "cluster" / "logs", v) for v in violations]
        kept = _keep(run_dir, s.seed)
        pytest.fail(f"chaos seed {s.seed}: {len(violations)} problem(s)\n\n" + "\n\n".join(violations)
                    + f"\n\nreplay: {s.replay()}\nplan, summary and every service's log: {kept}", pytrace=False)


def _keep(run_dir: Path, seed: int) -> Path:
    """Copy what a failed run leaves for diagnosis (not the etcd data or checkpoints) where pytest's rotation
    of its temporary directories does not delete it: $CHAOS_ARTIFACTS_DIR, default .trainyard/chaos/."""
    root = Path(os.environ.get("CHAOS_ARTIFACTS_DIR") or Path(__file__).resolve().parents[2] / ".trainyard" / "chaos")
    dest = root / f"seed-{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        dest.mkdir(parents=True)
        for name in ("plan.txt", "summary.json", "chaos.log"):
            if (run_dir / name).exists():
                shutil.copy2(run_dir / name, dest / name)
        for sub in ("events", "cluster/logs"):
            if (run_dir / sub).is_dir():
                shutil.copytree(run_dir / sub, dest / sub)
    except OSError:
        return run_dir
    return dest


async def _run(s: ChaosSettings, plan: Plan, cluster: LocalCluster, store: EtcdStore, http: httpx.AsyncClient,
               run_id: str, events: Path, say: Reporter) -> dict[str, Any]:
    ckpt = cluster.procs["checkpoint-store"]
    ckpt.env.update(CHECKPOINT_STORE_ENV)
    await asyncio.to_thread(cluster.restart, "checkpoint-store")
    await _wait_nodes_ready(http, len(NODES))

    faults: Faults | None = None
    checker = Checker(cluster, store, run_id, context=lambda: faults.recent() if faults else [])
    operator = Operator(cluster, http, store)
    faults = Faults(cluster, store, run_id, allocated=lambda: checker.allocated, operator=operator,
                    open_slow=checker.slow.open, close_slow=checker.slow.close)
    workload = Workload(http, run_id, events, max_in_flight=s.max_in_flight)
    checking, chaos = asyncio.Event(), asyncio.Event()
    checker_task = asyncio.create_task(checker.run(checking))
    t0 = time.monotonic()
    tasks = [asyncio.create_task(faults.run(plan.faults, chaos)), asyncio.create_task(workload.run(plan.jobs, chaos))]
    progress = asyncio.create_task(_progress(say, t0, faults, checker))
    try:
        # Until the duration is over (or a task fails: a refused job spec, a broken fault).
        await asyncio.wait(tasks, timeout=s.duration_s, return_when=asyncio.FIRST_EXCEPTION)
        chaos.set()
        await asyncio.gather(*tasks)
        say(f"t+{time.monotonic() - t0:.0f}s faults stop; healing")
        try:
            healed = await faults.heal()
            say(f"healed: {', '.join(healed) or 'nothing to do'}")
        except AssertionError as exc:
            checker.violation("(b) every accepted job ends or runs", "heal", str(exc))

        # Settle: no new jobs; every job should end. Running ones at the deadline are allowed by (b).
        deadline = time.monotonic() + s.settle_s
        unfinished: list[Any] = []
        while time.monotonic() < deadline:
            try:
                snap = await checker.snapshot()
            except Unavailable:
                await asyncio.sleep(0.5)
                continue
            unfinished = [j for j in snap.jobs.values() if not j.state.terminal]
            if not unfinished:
                break
            await asyncio.sleep(1.0)
        say(f"t+{time.monotonic() - t0:.0f}s settled: {len(unfinished)} job(s) not ended")
    finally:
        progress.cancel()
        chaos.set()
        for t in tasks:
            t.cancel()
        # Nothing stays frozen or cut, whatever happened above (idempotent after the heal).
        await asyncio.to_thread(faults.net.undo)
        checking.set()
        with contextlib.suppress(asyncio.CancelledError):
            await checker_task
        await operator.close()

    # -- final checks ----------------------------------------------------------------------------------
    snap = await checker.snapshot()
    for job in snap.jobs.values():
        if not job.state.terminal and job.state.value != "running":
            checker.violation("(b) every accepted job ends or runs", job.id,
                              f"{s.settle_s:g}s after the cluster was healed, job {job.id} ({job.spec.name}) is "
                              f"{job.state.value} at attempt {job.attempt}: {job.message}")
    for job_id, accepted in workload.accepted.items():
        if job_id not in snap.jobs:
            checker.violation("(b) every accepted job ends or runs", job_id,
                              f"job {job_id} ({accepted.plan.name}) was accepted by the gateway but is not in etcd")
    committed = await checker.final_checkpoints()
    resumes, mismatches = _read_events(events)
    for line in mismatches:
        checker.violation("(c) no committed checkpoint lost", f"restore {line.get('job_id')}/{line.get('attempt')}",
                          f"job {line.get('job_id')} attempt {line.get('attempt')} restored the checkpoint of step "
                          f"{line.get('step')} with other contents than it was saved with")
    ended = {j.id for j in snap.jobs.values() if j.state.terminal}
    strays = await _strays(run_id, ended)
    for w in strays:
        checker.violation("(e) no worker outlives its job", w.job_id,
                          f"{STRAY_DEADLINE_S:g}s after the settle, {w.describe()} still runs though the job ended")

    states = Counter(j.state.value for j in snap.jobs.values())
    kinds = Counter(f"{workload.accepted[j.id].plan.kind}:{j.state.value}" for j in snap.jobs.values()
                    if j.id in workload.accepted)
    done = Counter(r.kind for r in faults.records if r.outcome == "done")
    skipped = Counter(r.kind for r in faults.records if r.outcome.startswith("skipped"))
    failed = [r.describe() for r in faults.records if r.outcome.startswith("failed")]
    failures = Counter(re.sub(r"job-[0-9a-z]+|node-\d|\d+", "N", j.message)[:90] for j in snap.jobs.values()
                       if j.state.value == "failed")
    restarts = sum(j.restarts for j in snap.jobs.values())
    infra = sum(getattr(j, "infra_restarts", 0) for j in snap.jobs.values())
    say(f"faults done {dict(sorted(done.items()))}, skipped {dict(sorted(skipped.items()))}, failed {len(failed)}")
    say(f"jobs: {len(snap.jobs)} accepted, {dict(sorted(states.items()))}; restarts {restarts}, infra restarts "
        f"{infra}, cancels sent {workload.cancels}, submit retries {workload.submit_errors}; "
        f"checkpoint resumes {resumes}, checkpoints committed at the end {committed}")
    if failures:
        say(f"why jobs failed: {dict(failures.most_common())}")
    say(f"checks: {dict(sorted(checker.stats.items()))}")
    if operator.findings:
        say(f"operator findings (not invariants; see the report): {dict(operator.findings)}")
    return {
        "seed": s.seed, "duration_s": s.duration_s, "faults_planned": len(plan.faults),
        "faults_done": dict(sorted(done.items())), "faults_skipped": dict(sorted(skipped.items())),
        "faults_failed": failed, "fault_log": [r.describe() for r in faults.records],
        "jobs": len(snap.jobs), "jobs_by_state": dict(sorted(states.items())),
        "jobs_by_kind_and_state": dict(sorted(kinds.items())), "restarts": restarts, "infra_restarts": infra,
        "failure_reasons": dict(failures.most_common()),
        "cancels": workload.cancels, "checkpoint_resumes": resumes, "checkpoints_committed_at_end": committed,
        "checks": dict(sorted(checker.stats.items())), "operator_findings": dict(operator.findings),
        "checker_errors": checker.errors,
        "violations": [v.describe() for v in sorted(checker.violations.values(), key=lambda v: v.at)],
    }


async def _wait_nodes_ready(http: httpx.AsyncClient, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    nodes: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            r = await http.get("/v1/nodes")
            if r.status_code == 200:
                nodes = r.json()["nodes"]
                if sum(1 for n in nodes if n["state"] == "ready") >= count:
                    return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{count} ready nodes not seen after {timeout}s: {nodes}")


async def _progress(say: Reporter, t0: float, faults: Faults, checker: Checker) -> None:
    while True:
        await asyncio.sleep(15)
        snap = checker.last_snapshot
        states = Counter(j.state.value for j in snap.jobs.values()) if snap else Counter()
        say(f"t+{time.monotonic() - t0:.0f}s: {sum(1 for r in faults.records if r.outcome == 'done')} faults, "
            f"jobs {dict(sorted(states.items()))}, violations {len(checker.violations)}")


def _log_lines(logs: Path, violation: str, limit: int = 20) -> str:
    """The services' log lines about the jobs a violation names, up to a few seconds after it was seen (the
    last `limit`, in time order)."""
    jobs = sorted(set(re.findall(r"job-[0-9a-z]{10,}", violation)))
    seen = re.search(r"\((\d\d):(\d\d):(\d\d)\)", violation)
    if not jobs or not seen:
        return ""
    h, m, sec = (int(x) for x in seen.groups())
    until = time.strftime("%H:%M:%S", time.gmtime(h * 3600 + m * 60 + sec + 3))
    found: list[tuple[str, str]] = []
    for path in sorted(logs.glob("*.log")):
        with contextlib.suppress(OSError):
            found += [(line[:8], f"{path.stem}: {line}") for line in path.read_text(errors="replace").splitlines()
                      if line[:8] <= until and any(j in line for j in jobs) and "gateway GET " not in line]
    lines = [text for _, text in sorted(found, key=lambda x: x[0])]
    return "\n    log lines:\n" + "\n".join(f"      {line[:300]}" for line in lines[-limit:]) if lines else ""


def _read_events(events: Path) -> tuple[int, list[dict[str, Any]]]:
    resumes, mismatches = 0, []
    for path in events.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                resumes += event.get("event") == "resume"
                if event.get("event") == "mismatch":
                    mismatches.append(event)
    return resumes, mismatches


async def _strays(run_id: str, ended: set[str]) -> list[procs.WorkerProc]:
    deadline = time.monotonic() + STRAY_DEADLINE_S
    while True:
        strays = [w for w in await asyncio.to_thread(procs.workers, MARKER, run_id) if w.job_id in ended]
        if not strays or time.monotonic() > deadline:
            return [w for w in strays if procs.alive(w.pid, w.start_time)]
        await asyncio.sleep(1.0)

