"""The SDK's checkpoint methods against a real gateway, scheduler and checkpoint-store on mTLS
(tests/gateway/checkpoint_stack.py), with both clients: a job's checkpoints paged oldest first with their
lineage, one with its spec, its manifest, tag, untag and delete, and the refusals as their exceptions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.gateway.checkpoint_stack import Stack, running_stack
from trainyard_gateway.schemas.checkpoints import CheckpointList, CheckpointManifest, JobCheckpoint
from trainyard_sdk import FailedPrecondition, NotFound

from .support import Sdk, Sent


@pytest.fixture
async def stack(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path,
                tmp_path: Path) -> AsyncIterator[Stack]:
    async with running_stack(etcd=etcd_settings, prefix=key_prefix.rstrip("/"), pki_dir=pki_dir,
                             storage_root=tmp_path / "checkpoints") as s:
        yield s


async def test_checkpoints_of_a_job(sdk: Sdk, stack: Stack) -> None:
    alice = await stack.gateway.create_token("vision", "alice", role="member")
    job = await stack.submit(alice)
    async with stack.worker(job["id"]) as worker:
        saved = [await worker.save(step, code_version="git:abc123", job_spec={"name": "train"}) for step in (10, 20)]
        saved += [await worker.save(30), await worker.save(40)]
        writing = await worker.begin(50)
    sent: list[Sent] = []
    api = sdk(stack.gateway.url, alice, transport=sdk.recording(sent))

    listed = await api(lambda c: c.list_checkpoints(job["id"], page_size=2))
    assert [ck.id for ck in listed] == [*(s.id for s in saved), writing.id]  # oldest first, across 3 pages
    assert len(sent) == 3 and all(isinstance(ck, JobCheckpoint) for ck in listed)
    assert [ck.latest for ck in listed] == [False, False, False, True, False]
    assert (listed[0].step, listed[0].lineage.code_version, listed[0].lineage.job_spec) == (10, "git:abc123", None)
    page = await api(lambda c: c.list_checkpoints_page(job["id"], page_size=4))
    assert isinstance(page, CheckpointList) and page.next_page_token == saved[-1].id

    one = await api(lambda c: c.get_checkpoint(job["id"], saved[0].id))
    assert one.lineage.job_spec == {"name": "train"} and one.state == "committed"
    manifest = await api(lambda c: c.checkpoint_manifest(job["id"], saved[0].id))
    assert isinstance(manifest, CheckpointManifest) and manifest.size_bytes == saved[0].total_bytes
    assert [(s.path, s.size_bytes) for s in manifest.shards] == [(s.path, s.size_bytes) for s in saved[0].shards]
    with pytest.raises(FailedPrecondition, match=f"checkpoint {writing.id} is writing: it has no manifest"):
        await api(lambda c: c.checkpoint_manifest(job["id"], writing.id))

    assert (await api(lambda c: c.tag_checkpoint(job["id"], saved[0].id, "best"))).tags == ["best"]
    with pytest.raises(FailedPrecondition):  # tagged: untag it first
        await api(lambda c: c.delete_checkpoint(job["id"], saved[0].id))
    assert (await api(lambda c: c.untag_checkpoint(job["id"], saved[0].id, "best"))).tags == []
    deleted = await api(lambda c: c.delete_checkpoint(job["id"], saved[0].id))
    assert (deleted.state, deleted.deleted_at is not None) == ("deleted", True)
    with pytest.raises(NotFound):
        await api(lambda c: c.get_checkpoint(job["id"], "ckpt-00000000000000000000"))
