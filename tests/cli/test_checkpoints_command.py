"""`trainyard checkpoints JOB` against a real gateway, scheduler and checkpoint-store on mTLS (the checkpoints the
job's worker saved with its own credential): the table across pages, one checkpoint's lineage, the manifest
as a table and as JSON, tag, untag and delete, and the API's refusals as `error:` lines with exit code 1."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.checkpoint_stack import Stack, running_stack
from trainyard_checkpoint.domain.checkpoint import MANIFEST_NAME
from trainyard_cli.checkpoints import size


@pytest.fixture
async def stack(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    async with running_stack(etcd=etcd_settings, prefix=key_prefix.rstrip("/"), pki_dir=pki_dir,
                             storage_root=tmp_path / "checkpoints") as s:
        monkeypatch.setenv("TRAINYARD_URL", s.gateway.url)
        yield s


async def test_list_show_manifest_tag_untag_delete(cli: Any, stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    alice = await stack.gateway.create_token("vision", "alice", role="member")
    monkeypatch.setenv("TRAINYARD_TOKEN", alice)
    job = (await stack.submit(alice))["id"]
    r = await cli("checkpoints", job)
    assert (r.rc, r.out.strip()) == (0, f"job {job} has no checkpoints"), r.err

    async with stack.worker(job) as worker:
        saved = [await worker.save(step, code_version="git:abc123", parameters={"lr": "3e-4"},
                                   job_spec={"name": "train"}) for step in (10, 20)]
        writing = await worker.begin(30)

    r = await cli("checkpoints", job)
    assert r.rc == 0, r.err
    header, *rows = r.out.splitlines()
    assert header.split() == ["ID", "STEP", "STATE", "SIZE", "TAGS", "CREATED"]
    assert [row.split()[:6] for row in rows] == [
        [saved[0].id, "10", "committed", *size(saved[0].total_bytes).split(), "-"],
        [saved[1].id, "20", "committed,latest", *size(saved[1].total_bytes).split(), "-"],
        [writing.id, "30", "writing", "0", "B", "-"]]

    r = await cli("checkpoints", job, "--show", saved[0].id)
    assert r.rc == 0, r.err
    shown = {key: value.strip() for key, value in (line.split(": ", 1) for line in r.out.splitlines())}
    assert {"id": saved[0].id, "job": f"{job} (team vision)", "state": "committed", "step": "10", "attempt": "0",
            "code version": "git:abc123", "parameters": "lr=3e-4", "job spec": '{"name": "train"}',
            "size": f"{size(saved[0].total_bytes)} in 3 file(s)"}.items() <= shown.items(), r.out

    r = await cli("checkpoints", job, "--manifest", saved[1].id)
    assert r.rc == 0, r.err
    assert f"location: {saved[1].location} (manifest {MANIFEST_NAME})" in r.out
    assert {line.split()[-1] for line in r.out.splitlines()[3:]} == {s.path for s in saved[1].shards}
    r = await cli("checkpoints", job, "--manifest", saved[1].id, "--json")
    assert [s["checksum"] for s in json.loads(r.out)["shards"]] == [s.checksum for s in saved[1].shards]

    r = await cli("checkpoints", job, "--tag", saved[0].id, "best")
    assert (r.rc, r.out.strip()) == (0, f"tagged {saved[0].id} best (step 10, committed, tags: best)"), r.err
    r = await cli("checkpoints", job, "--delete", saved[0].id)
    assert r.rc == 1 and r.err.startswith("error: checkpoint") and "is tagged best" in r.err
    r = await cli("checkpoints", job, "--untag", saved[0].id, "best", "--json")
    assert (r.rc, json.loads(r.out)["tags"]) == (0, [])
    r = await cli("checkpoints", job, "--delete", saved[0].id)
    assert (r.rc, r.out.strip()) == (0, f"deleted {saved[0].id} (step 10, deleted, tags: -)"), r.err
    r = await cli("checkpoints", job, "--json")
    assert [(c["id"], c["state"]) for c in json.loads(r.out)["checkpoints"]] == [
        (saved[0].id, "deleted"), (saved[1].id, "committed"), (writing.id, "writing")]


async def test_every_page_is_listed(cli: Any, stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    alice = await stack.gateway.create_token("vision", "alice", role="member")
    monkeypatch.setenv("TRAINYARD_TOKEN", alice)
    job = (await stack.submit(alice))["id"]
    async with stack.worker(job) as worker:
        begun = [(await worker.begin(step, world_size=1)).id for step in range(5)]
    r = await cli("checkpoints", job, "--page-size", "2", "--json")
    assert r.rc == 0, r.err
    assert [c["id"] for c in json.loads(r.out)["checkpoints"]] == begun
    r = await cli("checkpoints", job, "--page-size", "2")
    assert [line.split()[0] for line in r.out.splitlines()[1:]] == begun


async def test_refusals_are_error_lines(cli: Any, stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    alice = await stack.gateway.create_token("vision", "alice", role="member")
    viewer = await stack.gateway.create_token("vision", "vic", role="viewer")
    nora = await stack.gateway.create_token("nlp", "nora", role="admin")
    job = (await stack.submit(alice))["id"]
    async with stack.worker(job) as worker:
        ckpt = await worker.save(10)
    r = await cli("checkpoints", job, "--token", viewer)
    assert r.rc == 0 and ckpt.id in r.out
    r = await cli("checkpoints", job, "--tag", ckpt.id, "best", "--token", viewer)
    assert r.rc == 1 and r.err.startswith("error: checkpoints.write needs the member role or higher")
    r = await cli("checkpoints", job, "--token", nora)
    assert (r.rc, r.err.strip()) == (1, f"error: job {job} not found")
    r = await cli("checkpoints", job, "--manifest", "ckpt-0000nothere", "--token", alice)
    assert (r.rc, r.err.strip()) == (1, "error: checkpoint ckpt-0000nothere not found")
    r = await cli("checkpoints", job, "--tag", ckpt.id, "--token", alice)  # NAME missing: a usage error
    assert r.rc == 2
    r = await cli("checkpoints", job, "--delete", ckpt.id, "--show", ckpt.id, "--token", alice)
    assert r.rc == 2 and "not allowed with argument" in r.err
