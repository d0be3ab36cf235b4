"""The checkpoint-store is SIGKILLed and started again while a job saves checkpoints, and the job is not
disturbed: its worker keeps its pid, the job stays at attempt 1 and ends SUCCEEDED.

What the client library does about the outage (trainyard_checkpoint/client/service.py): a call that gets
UNAVAILABLE is retried with backoff (0.05 s doubling to 2 s) for up to 30 s — Begin only on UNAVAILABLE,
the idempotent Commit/Abort also on DEADLINE_EXCEEDED — so the save that runs into the outage blocks
until the store is back and then commits; the training loop only sees a slow save. Were the outage
longer than the retry window, `save` would raise CheckpointError; programs/save_loop.py then exits with
code 3, failing the attempt (a restart if the job's restart policy allows one). The test asserts the
first case and that no save failed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from trainyard_checkpoint.client.env import WorkerTls
from trainyard_checkpoint.client.service import ServiceClient
from trainyard_cli.local import LocalCluster

from .support import PROGRAMS, Agents, Gateway, until

pytestmark = pytest.mark.e2e


def _progress(path: Path) -> tuple[list[int], dict[int, tuple[float, str]], list[str]]:
    """(steps begun, {step: (seconds, checkpoint id)} saved, failure lines) from save_loop's progress."""
    begun: list[int] = []
    saved: dict[int, tuple[float, str]] = {}
    failed: list[str] = []
    text = path.read_text() if path.exists() else ""
    for line in text.split("\n")[:-1]:  # the last piece is "" or a line still being written
        word, _, rest = line.partition(" ")
        if word == "begin":
            begun.append(int(rest))
        elif word == "saved":
            step, seconds, ckpt = rest.split()
            saved[int(step)] = (float(seconds), ckpt)
        elif word == "failed":
            failed.append(line)
    return begun, saved, failed


def test_checkpoint_store_restart_leaves_a_saving_job_undisturbed(cluster: LocalCluster, gateway: Gateway,
                                                                  agents: Agents, tmp_path: Path) -> None:
    job = gateway.submit({"name": "saves-through-restart",
                          "command": [sys.executable, str(PROGRAMS / "save_loop.py"), str(tmp_path)],
                          "resources": {"nodes": 1, "gpus_per_node": 1}, "checkpoint": {"every_steps": 1}})
    gateway.wait_state(job["id"], {"running"})
    workers = until(lambda: agents.running(job["id"]), 20, "the job's worker on its agent")
    progress, client_log = tmp_path / f"{job['id']}.progress", tmp_path / f"{job['id']}.client.log"
    until(lambda: len(_progress(progress)[1]) >= 2, 60, "two checkpoints saved before the fault")

    store = cluster.procs["checkpoint-store"]
    killed_at = time.monotonic()
    store.kill()
    until(lambda: client_log.exists() and "retrying" in client_log.read_text(), 20,
          "a save to run into the outage (the client logs its retries)")
    begun, saved, _ = _progress(progress)
    in_flight = begun[-1]
    assert in_flight not in saved, f"step {in_flight} should be waiting for the store"
    store.start()
    store.wait_ready()
    outage_s = time.monotonic() - killed_at

    until(lambda: in_flight in _progress(progress)[1], 40,
          f"the save of step {in_flight}, begun during the outage, to commit once the store is back")
    assert agents.running(job["id"]) == workers, "the job's worker changed while the store restarted"
    count = len(_progress(progress)[1])
    until(lambda: len(_progress(progress)[1]) >= count + 2, 20, "saves after the restart")
    (tmp_path / f"stop.{job['id']}").touch()

    done = gateway.wait_state(job["id"], {"succeeded"}, timeout=30)
    begun, saved, failed = _progress(progress)
    print(f"\ncheckpoint-store restart: outage {outage_s:.2f}s, the save begun during it took "
          f"{saved[in_flight][0]:.2f}s; {len(saved)} saves, none failed: {not failed}")
    assert failed == [], failed
    assert done["attempt"] == 1, done["events"]
    assert [(e["rank"], e["exit_code"]) for e in done["exits"]] == [(0, 0)]
    # The one worker that ever ran for the job is the one that ran before the fault.
    assert [(w.attempt, w.pid) for w in agents.workers(job["id"])] == [(1, workers[0].pid)]
    assert sorted(saved) == begun == list(range(1, len(begun) + 1))
    # Read back as the job's workers do, with a credential of its job issuer (the store serves mTLS).
    cred = cluster.job_credential(job["id"], done["attempt"], done["team"])
    service = ServiceClient(cluster.checkpoint_store_address, tls=WorkerTls(cred.cert_chain, cred.key, cred.ca),
                            timeout_s=10)
    try:
        states = {c.id: (c.step, c.state) for c in service.list_all(job["id"])}
        latest = service.latest(job["id"])
    finally:
        service.close()
    assert {ckpt: states.get(ckpt) for _, ckpt in saved.values()} == \
        {ckpt: (step, "COMMITTED") for step, (_, ckpt) in saved.items()}
    assert latest is not None and latest.step == max(saved)
