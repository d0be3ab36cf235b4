"""The client library end to end: real gloo workers save through the real checkpoint-store; jobs of
other world sizes load what they saved, bit for bit; stock DCP reads it without Trainyard installed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_checkpoint.app import CheckpointApp

from .checkpoint_support import Client, location_dir
from .scripts.gang import Zygote, job_env, run_gang, zygote_fixture  # noqa: F401 - the zygote fixture

REPO = Path(__file__).resolve().parents[2]


async def test_two_ranks_save_one_and_three_ranks_load_bit_exact(app: CheckpointApp, client: Client, tmp_path: Path,
                                                                   zygote: Zygote) -> None:
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-roundtrip")
    saved = await run_gang(zygote, ["save", "1", "2"], world_size=2, env=env, out=tmp_path / "save")
    records = saved[0]["saved"]
    assert [r["step"] for r in records] == [1, 2] and all(r["state"] == "COMMITTED" for r in records)
    assert saved[1]["saved"] == records, "every rank returns the same committed checkpoints"

    latest = await client.latest("job-roundtrip")
    assert latest.id == records[1]["id"] and latest.state == pb.CHECKPOINT_STATE_COMMITTED
    declared = {s.path: s for s in latest.shards}
    # Two writer threads per rank: two .distcp files each, plus rank 0's .metadata.
    assert set(declared) == {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", ".metadata"}
    assert {declared[p].rank for p in ("__1_0.distcp", "__1_1.distcp")} == {1}
    assert all(s.checksum.startswith("xxh3c:") for s in latest.shards)
    on_disk = {p.name for p in location_dir(latest.location).iterdir()} - {latest.manifest_path}
    assert on_disk == set(declared), "every file in the checkpoint is declared, no temp file is left"

    one, three = await asyncio.gather(
        run_gang(zygote, ["load"], world_size=1, env=env, out=tmp_path / "load1"),
        run_gang(zygote, ["load"], world_size=3, env=env, out=tmp_path / "load3"))
    for report in one + three:
        assert report["step"] == 2 and report["checkpoint"] == latest.id, report
        assert report["mismatches"] == [] and report["skipped"] == [], report


async def test_stock_dcp_reads_a_trainyard_checkpoint_without_trainyard(
        app: CheckpointApp, client: Client, tmp_path: Path, zygote: Zygote) -> None:
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-stock")
    saved = await run_gang(zygote, ["save", "5"], world_size=2, env=env, out=tmp_path / "save")
    location = location_dir((await client.latest("job-stock")).location)
    # -S: no site-packages processing, so neither the editable installs of Trainyard nor its .pth files;
    # only torch's own site-packages directory is put back on the path.
    plain_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": sysconfig.get_paths()["purelib"],
                 "PYTHONNOUSERSITE": "1"}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-S", str(REPO / "examples" / "read_with_plain_dcp.py"), str(location),
                         "--json"], env=plain_env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    read = json.loads(done.stdout)
    assert read["trainyard_importable"] is False
    assert read["digests"] == {k: v for k, v in saved[0]["digests"]["5"].items()}
    assert read["objects"] == {"extra.step": 5, "extra.note": "state of step 5"}
