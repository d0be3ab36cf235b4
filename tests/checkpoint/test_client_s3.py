"""The client library on S3 (a real `moto_server`): the same DCP files, checksummed as they are uploaded,
committed, and loaded resharded. Workers reach the bucket through fsspec/s3fs with the standard AWS
environment variables, as a job on a cloud pool would."""

from __future__ import annotations

import asyncio
from pathlib import Path

from trainyard_checkpoint.app import CheckpointApp

from .checkpoint_support import Client
from .conftest import S3_KEY, S3_REGION, S3_SECRET, MotoServer
from .scripts.gang import Zygote, job_env, run_gang, zygote_fixture  # noqa: F401 - the zygote fixture


async def test_round_trip_on_s3_two_ranks_save_one_and_three_load(
        s3_app: CheckpointApp, s3_client: Client, moto_server: MotoServer, tmp_path: Path, zygote: Zygote) -> None:
    env = job_env(f"127.0.0.1:{s3_app.grpc_port}", "job-s3", AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET,
                  AWS_DEFAULT_REGION=S3_REGION, AWS_ENDPOINT_URL=moto_server.endpoint)
    saved = (await run_gang(zygote, ["save", "1", "2"], world_size=2, env=env, out=tmp_path / "save"))[0]["saved"]
    assert all(r["location"].startswith("s3://") and r["state"] == "COMMITTED" for r in saved), saved
    latest = await s3_client.latest("job-s3")
    assert latest.id == saved[1]["id"]
    assert {s.path for s in latest.shards} == {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp",
                                              ".metadata"}
    one, three = await asyncio.gather(run_gang(zygote, ["load"], world_size=1, env=env, out=tmp_path / "load1"),
                                      run_gang(zygote, ["load"], world_size=3, env=env, out=tmp_path / "load3"))
    for report in one + three:
        assert report["step"] == 2 and report["mismatches"] == [] and report["skipped"] == [], report
