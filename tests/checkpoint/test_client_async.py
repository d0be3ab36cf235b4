"""async_save: the trainer blocks only for the copy to shared memory; a separate saver process persists
and commits the checkpoint while training goes on and changes the tensors."""

from __future__ import annotations

from pathlib import Path

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_checkpoint.app import CheckpointApp

from .checkpoint_support import Client
from .scripts.gang import Zygote, job_env, run_gang, zygote_fixture  # noqa: F401 - the zygote fixture


async def test_async_save_persists_in_a_saver_process_while_training_changes_the_state(
        app: CheckpointApp, client: Client, tmp_path: Path, zygote: Zygote) -> None:
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-async")
    reports = await run_gang(zygote, ["async"], world_size=2, env=env, out=tmp_path / "async", timeout=120)
    first = reports[0]
    for r in reports:
        assert r["ids"] == first["ids"], "every rank's handle names the same committed checkpoints"
        assert r["states"] == ["COMMITTED"] * 3, r
        assert all(pid and pid != r["pid"] for pid in r["saver_pids"]), "the save runs in another process"
        assert len(set(r["saver_pids"])) == 1, "one saver process serves the rank's saves"
        # The call returned before the checkpoint was written, and training went on meanwhile.
        assert r["done_at_return"] is False and r["steps_during"] > 0, r
        # One save in flight: the third call waited for the second.
        assert r["second_done_when_third_returned"] is True, r
        for t in r["timings"]:
            assert 0 <= t["staging_s"] <= t["blocking_s"] < t["total_s"], t
        # Every tensor was changed right after each call returned; the checkpoint has the values of the call.
        assert r["loaded_step"] == 3 and r["mismatches"] == [], r
    for checkpoint_id in first["ids"]:
        got = (await client.stub.GetCheckpoint(pb.GetCheckpointRequest(checkpoint_id=checkpoint_id))).checkpoint
        assert got.state == pb.CHECKPOINT_STATE_COMMITTED
    assert (await client.latest("job-async")).id == first["ids"][2]


async def test_a_saver_killed_mid_save_fails_the_save_on_every_rank_and_the_next_save_works(
        app: CheckpointApp, client: Client, tmp_path: Path, zygote: Zygote) -> None:
    # Rank 0's saver kills itself at its 60th point: in the middle of writing its files.
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-async-crash", TRAINYARD_TEST_KILL_AT="0:60")
    reports = await run_gang(zygote, ["async-crash"], world_size=2, env=env, out=tmp_path / "crash", timeout=120)
    assert "saver process died" in reports[0]["error"], reports[0]
    assert reports[1]["error"], "the other rank's save fails too, it does not hang"
    for r in reports:
        assert r["saver_pids"][0] != r["saver_pids"][1], "every rank replaced its saver"
        assert r["second_state"] == "COMMITTED" and r["second"] == reports[0]["second"], r
        assert r["loaded_step"] == 2 and r["mismatches"] == [], r
    records = (await client.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id="job-async-crash"))).checkpoints
    assert sorted((c.step, c.state == pb.CHECKPOINT_STATE_COMMITTED) for c in records) == [(1, False), (2, True)]
