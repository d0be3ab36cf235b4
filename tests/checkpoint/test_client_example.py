"""examples/train_with_checkpoints.py as a job would run it: killed mid-run, restarted, resumed from its
latest checkpoint, it ends with exactly the weights of a run that never stopped."""

from __future__ import annotations

import json
from pathlib import Path

from trainyard_checkpoint.app import CheckpointApp

from .checkpoint_support import Client
from .scripts.gang import Zygote, job_env, run_gang, zygote_fixture  # noqa: F401 - the zygote fixture

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_with_checkpoints.py"


async def test_the_example_resumes_after_a_crash_to_the_weights_of_an_uninterrupted_run(
        app: CheckpointApp, client: Client, tmp_path: Path, zygote: Zygote) -> None:
    address = f"127.0.0.1:{app.grpc_port}"
    common = ["--steps", "12", "--every", "4", "--sync"]

    straight = tmp_path / "straight.json"
    await run_gang(zygote, [*common, "--out", str(straight)], world_size=2, script=EXAMPLE, reports=False,
                   env=job_env(address, "job-straight"), out=tmp_path / "straight")

    crashed = job_env(address, "job-crashed")
    await run_gang(zygote, [*common, "--stop-after", "10"], world_size=2, script=EXAMPLE, reports=False,
                   exit_code=3, env=crashed, out=tmp_path / "crash")
    assert (await client.latest("job-crashed")).step == 8
    resumed = tmp_path / "resumed.json"
    await run_gang(zygote, [*common, "--out", str(resumed)], world_size=2, script=EXAMPLE, reports=False,
                   env={**crashed, "TRAINYARD_ATTEMPT": "1"}, out=tmp_path / "resume")

    a, b = json.loads(straight.read_text()), json.loads(resumed.read_text())
    assert a["start"] == 0 and b["start"] == 8
    assert b["weights"] == a["weights"], "the resumed run must end bit for bit where the uninterrupted one did"
    assert (await client.latest("job-crashed")).step == 12
