"""A job that checkpoints with the client library, crashes on its first attempt and is restarted by the
scheduler's restart policy resumes from its latest checkpoint — through the local cluster's real
processes (scheduler → agents → workers → checkpoint-store), ending with the weights of an uninterrupted
run."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from .conftest import Api

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_with_checkpoints.py"


def _run(api: Api, name: str, script: str, tmp_path: Path) -> dict:  # type: ignore[type-arg]
    job = api.submit({"name": name, "command": ["sh", "-c", script], "max_restarts": 1, "restart_backoff_s": 0,
                      "resources": {"nodes": 2, "gpus_per_node": 1, "allow_mixed": True},
                      "checkpoint": {"every_steps": 4}})
    return api.wait(job["id"], {"succeeded", "failed"}, timeout=180)


def test_a_restarted_job_resumes_from_its_latest_checkpoint(api: Api, tmp_path: Path) -> None:
    base = f"{shlex.quote(sys.executable)} {shlex.quote(str(EXAMPLE))} --steps 12 --every 4 --sync"
    straight_out = tmp_path / "straight.json"
    resumed_out = tmp_path / "resumed.json"
    straight = _run(api, "straight", f"exec {base} --out {straight_out}", tmp_path)
    assert straight["state"] == "succeeded", straight["message"]
    # Attempt 1 dies abruptly after step 10 (last checkpoint: step 8); attempt 2 runs to the end.
    crash_once = (f'if [ "$TRAINYARD_ATTEMPT" = 1 ]; then exec {base} --stop-after 10; '
                  f"else exec {base} --out {resumed_out}; fi")
    resumed = _run(api, "crash-once", crash_once, tmp_path)
    assert resumed["state"] == "succeeded", resumed["message"]
    assert resumed["attempt"] == 2 and resumed["restarts"] == 1
    logs = api.http.get(f"/v1/jobs/{resumed['id']}/logs").text
    assert "starting at step 9 (resumed)" in logs
    import json

    a, b = json.loads(straight_out.read_text()), json.loads(resumed_out.read_text())
    assert (a["start"], b["start"]) == (0, 8)
    assert a["weights"] == b["weights"], "the resumed run must end bit for bit where the uninterrupted one did"
