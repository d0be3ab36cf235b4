"""/v1/jobs/{job_id}/checkpoints against a real gateway, scheduler and checkpoint-store on mTLS (checkpoint_stack):
what a job's workers saved is listed page by page with its lineage, shown one by one, tagged, untagged,
deleted and described by its manifest; role scoping (a viewer reads only, a member changes only its own
jobs' checkpoints, a team admin its team's, an operator any team's, another team sees 404); every error path;
the audit entries of the changes; a gateway without a checkpoint-store, and a store that is down or refuses."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint.checkpoint_support import location_dir
from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_checkpoint.access import TEAM_HEADER
from trainyard_checkpoint.domain.checkpoint import MANIFEST_NAME
from trainyard_checkpoint.domain.validation import is_checkpoint_id, validate_tag
from trainyard_core import contract as c
from trainyard_core.audit import AuditFilter, AuditLog
from trainyard_core.errors import InvalidArgument, NotFound, Unavailable
from trainyard_core.rpc.channels import Channels
from trainyard_core.security import identity, pki
from trainyard_core.settings import SettingsError, load_settings
from trainyard_gateway.app import create_app
from trainyard_gateway.checkpoint_client import TEAM_METADATA, CheckpointStoreClient, state_name
from trainyard_gateway.routers.checkpoints import NO_STORE
from trainyard_gateway.settings import GatewaySettings

from .checkpoint_stack import Stack, Worker, running_stack
from .support import RunningGateway

BASE = "/v1/jobs/{job}/checkpoints"


@pytest.fixture
async def stack(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path,
                tmp_path: Path) -> AsyncIterator[Stack]:
    async with running_stack(etcd=etcd_settings, prefix=key_prefix.rstrip("/"), pki_dir=pki_dir,
                             storage_root=tmp_path / "checkpoints") as s:
        yield s


def path(job: str, rest: str = "") -> str:
    return BASE.format(job=job) + rest


@contextlib.asynccontextmanager
async def alices_job(stack: Stack) -> AsyncIterator[tuple[str, dict[str, Any], Worker]]:
    """alice (member of vision) submits a job; yields her token, the job and the job's worker."""
    alice = await stack.gateway.create_token("vision", "alice", role="member")
    job = await stack.submit(alice)
    async with stack.worker(job["id"]) as worker:
        yield alice, job, worker


# --- the vocabulary, once ---------------------------------------------------------------------------------------

def test_the_gateway_and_the_store_share_their_names() -> None:
    assert TEAM_METADATA == TEAM_HEADER
    assert [state_name(v) for v in sorted(pb.CheckpointState.values())[1:]] == list(c.CHECKPOINT_STATES)
    assert state_name(99) == "unknown"
    for text in ("ckpt-", "ckpt-01m8rd01bvcpnb6077", "ckpt-" + "a" * 58):
        assert c.CHECKPOINT_ID.matches(text) and is_checkpoint_id(text), text
    for text in ("ckpt", "job-1", "ckpt-A", "ckpt-" + "a" * 59, "ckpt-x\n", "xckpt-1"):
        assert not c.CHECKPOINT_ID.matches(text) and not is_checkpoint_id(text), text
    for tag in ("best", "release-1.0", "a", "x" * 63):
        validate_tag(tag)
        assert c.CHECKPOINT_TAG.matches(tag)
    for tag in ("", "-best", "a b", "x" * 64, "best\n"):  # re.match's `$` took "best\n" before the contract rule
        with pytest.raises(InvalidArgument):
            validate_tag(tag)
        assert not c.CHECKPOINT_TAG.matches(tag)


def test_the_document_states_the_contracts_rules() -> None:
    doc = create_app(None).openapi()  # type: ignore[arg-type]  # the document needs no dependencies
    base = "/v1/jobs/{job_id}/checkpoints"

    def parameter(where: str, method: str, name: str) -> dict[str, Any]:
        found = next(p for p in doc["paths"][where][method]["parameters"] if p["name"] == name)
        return dict(found["schema"])

    assert parameter(base, "get", "page_token")["pattern"] == c.CHECKPOINT_ID.or_empty.pattern
    assert parameter(base, "get", "page_size")["maximum"] == c.MAX_PAGE_SIZE
    for where, method in ((base + "/{checkpoint_id}", "get"), (base + "/{checkpoint_id}", "delete"),
                          (base + "/{checkpoint_id}/manifest", "get"), (base + "/{checkpoint_id}/tags/{tag}", "put")):
        assert parameter(where, method, "checkpoint_id")["pattern"] == c.CHECKPOINT_ID.pattern
        assert parameter(where, method, "job_id")["pattern"] == c.ID.pattern
    assert parameter(base + "/{checkpoint_id}/tags/{tag}", "delete", "tag")["pattern"] == c.CHECKPOINT_TAG.pattern
    states = doc["components"]["schemas"]["JobCheckpoint"]["properties"]["state"]["enum"]
    assert states == [*c.CHECKPOINT_STATES, "unknown"]
    writes = {status for where, item in doc["paths"].items() if where.startswith(base)
              for method, op in item.items() if method in ("put", "delete") for status in op["responses"]}
    assert writes == {"200", "400", "401", "403", "404", "409", "429", "503", "507"}


def test_the_store_address_setting() -> None:
    assert load_settings(GatewaySettings, prog="g", argv=[], env={}).checkpoint_store_address == ""
    s = load_settings(GatewaySettings, prog="g", argv=["--checkpoint-store-address", " ckpt.internal:50053 "], env={})
    assert s.checkpoint_store_address == "ckpt.internal:50053"
    with pytest.raises(SettingsError, match="is not host:port"):
        load_settings(GatewaySettings, prog="g", argv=[], env={"TRAINYARD_GATEWAY_CHECKPOINT_STORE_ADDRESS": "ckpt"})


# --- reading ----------------------------------------------------------------------------------------------------

async def test_list_pages_in_creation_order_with_lineage(stack: Stack) -> None:
    async with alices_job(stack) as (_, job, worker):
        first = await worker.save(10, code_version="git:abc123", parameters={"lr": "3e-4"},
                                  job_spec={"name": "train", "epochs": 3})
        second = await worker.save(20, code_version="git:abc123")
        third = await worker.save(30, world_size=3, code_version="git:def456")
        writing = await worker.begin(40)
        viewer = await stack.gateway.create_token("vision", "vic", role="viewer")
        async with stack.gateway.client(viewer) as http:
            page = (await http.get(path(job["id"]), params={"page_size": 2})).json()
            assert [ck["id"] for ck in page["checkpoints"]] == [first.id, second.id]
            assert page["next_page_token"] == second.id
            later = await worker.begin(50)  # begun while paging: on a later page, the earlier ones unmoved
            rest = (await http.get(path(job["id"]), params={"page_size": 2,
                                                            "page_token": page["next_page_token"]})).json()
            assert [ck["id"] for ck in rest["checkpoints"]] == [third.id, writing.id]
            last = (await http.get(path(job["id"]), params={"page_size": 2,
                                                            "page_token": rest["next_page_token"]})).json()
            assert ([ck["id"] for ck in last["checkpoints"]], last["next_page_token"]) == ([later.id], "")
            whole = (await http.get(path(job["id"]))).json()
            assert [ck["id"] for ck in whole["checkpoints"]] == [first.id, second.id, third.id, writing.id, later.id]
            assert whole["next_page_token"] == ""

            shown = {ck["id"]: ck for ck in whole["checkpoints"]}
            one = shown[first.id]
            assert (one["job_id"], one["team"], one["attempt"], one["step"], one["world_size"], one["state"]) == \
                (job["id"], "vision", 0, 10, 2, "committed")
            assert (one["size_bytes"], one["shard_count"]) == (first.total_bytes, 3) and first.total_bytes > 0
            assert one["lineage"] == {"code_version": "git:abc123", "parameters": {"lr": "3e-4"}, "job_spec": None}
            assert one["metadata"]["format"] == "torch.distributed.checkpoint"
            assert one["location"] == first.location and one["location"].startswith("file:///")
            assert one["created_at"] and one["committed_at"] and one["deleted_at"] is None
            assert [ck["latest"] for ck in whole["checkpoints"]] == [False, False, True, False, False]
            assert (shown[third.id]["shard_count"], shown[third.id]["lineage"]["code_version"]) == (4, "git:def456")
            assert (shown[writing.id]["state"], shown[writing.id]["size_bytes"], shown[writing.id]["committed_at"]) \
                == ("writing", 0, None)

            got = (await http.get(path(job["id"], f"/{first.id}"))).json()
            assert got["lineage"]["job_spec"] == {"name": "train", "epochs": 3}
            assert {k: v for k, v in got.items() if k != "lineage"} == {k: v for k, v in one.items() if k != "lineage"}
            assert (await http.get(path(job["id"], f"/{second.id}"))).json()["lineage"]["job_spec"] is None


async def test_a_job_without_checkpoints_lists_none(stack: Stack) -> None:
    alice = await stack.gateway.create_token("vision", "alice", role="member")
    job = await stack.submit(alice)  # its workers never reached the store: no team recorded there
    async with stack.gateway.client(alice) as http:
        reply = await http.get(path(job["id"]))
    assert reply.status_code == 200 and reply.json() == {"checkpoints": [], "next_page_token": ""}


async def test_manifest_lists_every_file_for_download(stack: Stack) -> None:
    async with alices_job(stack) as (alice, job, worker):
        saved = await worker.save(10)
        writing = await worker.begin(20)
        aborted = await worker.begin(30)
        await worker.client.abort(aborted.id, "worker died")
    async with stack.gateway.client(alice) as http:
        manifest = (await http.get(path(job["id"], f"/{saved.id}/manifest"))).json()
        assert {k: manifest[k] for k in ("checkpoint_id", "job_id", "step", "world_size", "state", "location",
                                         "manifest_file", "size_bytes")} == \
            {"checkpoint_id": saved.id, "job_id": job["id"], "step": 10, "world_size": 2, "state": "committed",
             "location": saved.location, "manifest_file": MANIFEST_NAME, "size_bytes": saved.total_bytes}
        assert manifest["shards"] == [{"path": s.path, "rank": s.rank, "size_bytes": s.size_bytes,
                                       "checksum": s.checksum} for s in saved.shards]
        base = location_dir(manifest["location"])
        for shard in manifest["shards"]:  # what a download tool does: every file is there, of its size
            assert (base / shard["path"]).stat().st_size == shard["size_bytes"]
        assert (base / manifest["manifest_file"]).is_file()
        for ckpt, state in ((writing, "writing"), (aborted, "aborted")):
            reply = await http.get(path(job["id"], f"/{ckpt.id}/manifest"))
            assert reply.status_code == 409, reply.text
            assert reply.json()["error"]["message"].startswith(f"checkpoint {ckpt.id} is {state}: it has no manifest")


# --- changing ---------------------------------------------------------------------------------------------------

async def test_tag_untag_and_delete(stack: Stack) -> None:
    async with alices_job(stack) as (alice, job, worker):
        old = await worker.save(10)
        latest = await worker.save(20)
        writing = await worker.begin(30)
    async with stack.gateway.client(alice) as http:
        tagged = await http.put(path(job["id"], f"/{old.id}/tags/best"))
        assert tagged.status_code == 200 and tagged.json()["tags"] == ["best"], tagged.text
        again = await http.put(path(job["id"], f"/{old.id}/tags/best"))
        assert (again.status_code, again.json()["tags"]) == (200, ["best"])  # idempotent
        assert (await http.put(path(job["id"], f"/{old.id}/tags/release-1.0"))).json()["tags"] == ["best",
                                                                                                    "release-1.0"]
        refused = await http.delete(path(job["id"], f"/{old.id}"))
        assert refused.status_code == 409 and "is tagged best, release-1.0" in refused.json()["error"]["message"]
        for tag in ("best", "release-1.0", "release-1.0"):  # the last: a tag it lacks, idempotent
            reply = await http.delete(path(job["id"], f"/{old.id}/tags/{tag}"))
            assert reply.status_code == 200, reply.text
        assert reply.json()["tags"] == []

        on_writing = await http.put(path(job["id"], f"/{writing.id}/tags/best"))
        assert on_writing.status_code == 409 and "only committed checkpoints are tagged" in on_writing.text
        of_latest = await http.delete(path(job["id"], f"/{latest.id}"))
        assert of_latest.status_code == 409 and "is the latest checkpoint" in of_latest.json()["error"]["message"]
        of_writing = await http.delete(path(job["id"], f"/{writing.id}"))
        assert of_writing.status_code == 409 and "abort it first" in of_writing.json()["error"]["message"]

        deleted = await http.delete(path(job["id"], f"/{old.id}"))
        assert deleted.status_code == 200, deleted.text
        assert (deleted.json()["state"], deleted.json()["latest"]) == ("deleted", False)
        assert deleted.json()["deleted_at"] is not None
        assert not location_dir(old.location).exists()
        assert (await http.delete(path(job["id"], f"/{old.id}"))).json()["state"] == "deleted"  # idempotent
        gone = await http.get(path(job["id"], f"/{old.id}/manifest"))
        assert gone.status_code == 409 and "its files are removed" in gone.text
        listed = (await http.get(path(job["id"]))).json()["checkpoints"]
        assert [(ck["id"], ck["state"]) for ck in listed] == [(old.id, "deleted"), (latest.id, "committed"),
                                                              (writing.id, "writing")]


async def test_a_checkpoint_holds_at_most_16_tags(stack: Stack) -> None:
    async with alices_job(stack) as (alice, job, worker):
        ckpt = await worker.save(10)
    async with stack.gateway.client(alice) as http:
        for i in range(16):
            assert (await http.put(path(job["id"], f"/{ckpt.id}/tags/t{i}"))).status_code == 200
        reply = await http.put(path(job["id"], f"/{ckpt.id}/tags/one-more"))
    assert reply.status_code == 409 and "already has 16 tags" in reply.json()["error"]["message"]


# --- who may ----------------------------------------------------------------------------------------------------

async def test_roles_scope_reads_and_changes(stack: Stack) -> None:
    gw = stack.gateway
    async with alices_job(stack) as (alice, job, worker):
        ckpt = await worker.save(10)
        await worker.save(20)
    tokens = {name: await gw.create_token(team, name, role=role) for name, team, role in (
        ("vic", "vision", "viewer"), ("bob", "vision", "member"), ("ada", "vision", "admin"),
        ("nora", "nlp", "admin"), ("olga", "ops", "operator"))}
    scoped = await gw.create_token("vision", "sam", role="admin", scopes=["jobs:read"])
    tag = path(job["id"], f"/{ckpt.id}/tags/best")
    changes = [("PUT", tag), ("DELETE", tag), ("DELETE", path(job["id"], f"/{ckpt.id}"))]
    reads = [("GET", path(job["id"])), ("GET", path(job["id"], f"/{ckpt.id}")),
             ("GET", path(job["id"], f"/{ckpt.id}/manifest"))]

    async with gw.client(tokens["vic"]) as viewer:
        for method, where in reads:
            assert (await viewer.request(method, where)).status_code == 200, where
        for method, where in changes:
            reply = await viewer.request(method, where)
            assert reply.status_code == 403 and reply.json()["error"]["message"].startswith(
                "checkpoints.write needs the member role or higher"), (method, where, reply.text)
    async with gw.client(tokens["bob"]) as teammate:
        assert (await teammate.get(path(job["id"]))).status_code == 200
        for method, where in changes:
            reply = await teammate.request(method, where)
            assert reply.status_code == 403 and reply.json()["error"]["message"].startswith(
                "only the job's submitter or a team admin may tag, untag or delete its checkpoints (submitted by "
                "alice"), reply.text
    async with gw.client(scoped) as narrowed:
        reply = await narrowed.put(tag)
        assert reply.status_code == 403 and "needs the scope jobs:write" in reply.json()["error"]["message"]
        assert (await narrowed.get(path(job["id"]))).status_code == 200
    async with gw.client(tokens["nora"]) as other_team:
        for method, where in reads + changes:
            reply = await other_team.request(method, where)
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found", (method, where)
            assert reply.json()["error"]["message"] == f"job {job['id']} not found", reply.text
    async with gw.client(tokens["ada"]) as admin:
        assert (await admin.put(tag)).json()["tags"] == ["best"]
    async with gw.client(tokens["olga"]) as operator:
        shown = (await operator.get(path(job["id"], f"/{ckpt.id}"))).json()
        assert (shown["team"], shown["tags"]) == ("vision", ["best"])
        assert (await operator.delete(tag)).json()["tags"] == []
        assert (await operator.delete(path(job["id"], f"/{ckpt.id}"))).json()["state"] == "deleted"
    async with gw.client(alice) as owner:
        assert (await owner.put(path(job["id"], f"/{ckpt.id}/tags/x"))).status_code == 409  # deleted now


async def test_a_checkpoint_of_another_job_is_not_found(stack: Stack) -> None:
    async with alices_job(stack) as (alice, job, worker):
        other = await stack.submit(alice, "other")
        async with stack.worker(other["id"]) as other_worker:
            mine = await worker.save(10)
            theirs = await other_worker.save(10)
    async with stack.gateway.client(alice) as http:
        assert (await http.get(path(other["id"], f"/{theirs.id}"))).status_code == 200
        for method, suffix in (("GET", ""), ("GET", "/manifest"), ("PUT", "/tags/best"), ("DELETE", "/tags/best"),
                               ("DELETE", "")):
            reply = await http.request(method, path(job["id"], f"/{theirs.id}{suffix}"))
            assert reply.status_code == 404, (method, suffix, reply.text)
            assert reply.json()["error"]["message"] == f"checkpoint {theirs.id} not found in job {job['id']}"
        assert (await http.get(path(other["id"], f"/{theirs.id}"))).json()["tags"] == []
        assert (await http.get(path(job["id"], f"/{mine.id}"))).status_code == 200


# --- every error path -------------------------------------------------------------------------------------------

async def test_error_paths(stack: Stack) -> None:
    async with alices_job(stack) as (alice, job, worker):
        ckpt = await worker.save(10)
    j = job["id"]
    cases = [
        ("GET", path("job-nope"), None, 404, "not_found"),
        ("GET", path("job-nope", f"/{ckpt.id}"), None, 404, "not_found"),
        ("PUT", path("job-nope", f"/{ckpt.id}/tags/best"), None, 404, "not_found"),
        ("GET", path(j, "/ckpt-0000nothere"), None, 404, "not_found"),
        ("DELETE", path(j, "/ckpt-0000nothere"), None, 404, "not_found"),
        ("GET", path(j, "/ckpt-0000nothere/manifest"), None, 404, "not_found"),
        ("GET", path(j, "/not-a-checkpoint"), None, 400, "invalid_argument"),
        ("GET", path("J"), None, 400, "invalid_argument"),
        ("PUT", path(j, f"/{ckpt.id}/tags/-bad"), None, 400, "invalid_argument"),
        ("PUT", path(j, f"/{ckpt.id}/tags/best%0A"), None, 400, "invalid_argument"),
        ("PUT", path(j, f"/{ckpt.id}/tags/" + "x" * 64), None, 400, "invalid_argument"),
        ("GET", path(j), {"page_size": 0}, 400, "invalid_argument"),
        ("GET", path(j), {"page_size": c.MAX_PAGE_SIZE + 1}, 400, "invalid_argument"),
        ("GET", path(j), {"page_token": "not-a-token"}, 400, "invalid_argument"),
        ("POST", path(j, f"/{ckpt.id}"), None, 405, "method_not_allowed"),
        ("POST", path(j, f"/{ckpt.id}/tags/best"), None, 405, "method_not_allowed"),
    ]
    async with stack.gateway.client(alice) as http:
        for method, where, params, status, code in cases:
            reply = await http.request(method, where, params=params)
            assert (reply.status_code, reply.json()["error"]["code"]) == (status, code), (method, where, reply.text)
        assert "page_token" in (await http.get(path(j), params={"page_token": "x"})).json()["error"]["message"]
        reply = await http.get(path(j, "/ckpt-0000nothere"))
        assert reply.json()["error"]["message"] == "checkpoint ckpt-0000nothere not found"
        allow = await http.options(path(j, f"/{ckpt.id}/tags/best"))
        assert (allow.status_code, allow.headers["allow"]) == (204, "DELETE, PUT, OPTIONS")
    async with stack.gateway.client() as anonymous:
        reply = await anonymous.get(path(j))
        assert reply.status_code == 401


async def test_a_store_that_is_down_answers_503(stack: Stack) -> None:
    async with alices_job(stack) as (alice, job, worker):
        ckpt = await worker.save(10)
    await stack.store.stop()
    async with stack.gateway.client(alice) as http:
        for method, where in (("GET", path(job["id"])), ("PUT", path(job["id"], f"/{ckpt.id}/tags/best"))):
            reply = await http.request(method, where)
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["message"].startswith("checkpoint-store is unavailable")
            assert reply.headers["retry-after"] == "1"


async def test_without_a_checkpoint_store_the_routes_answer_503(etcd_settings: dict[str, str], key_prefix: str,
                                                                pki_dir: Path, tmp_path: Path) -> None:
    async with running_stack(etcd=etcd_settings, prefix=key_prefix.rstrip("/"), pki_dir=pki_dir,
                             storage_root=tmp_path / "checkpoints", store=False) as stack:
        alice = await stack.gateway.create_token("vision", "alice", role="member")
        job = await stack.submit(alice)
        async with stack.gateway.client(alice) as http:
            for method, where in (("GET", path(job["id"])), ("GET", path(job["id"], "/ckpt-1")),
                                  ("PUT", path(job["id"], "/ckpt-1/tags/best")),
                                  ("DELETE", path(job["id"], "/ckpt-1"))):
                reply = await http.request(method, where)
                assert (reply.status_code, reply.json()["error"]["message"]) == (503, NO_STORE), (method, where)
            assert (await http.get(path("job-nope"))).status_code == 404  # the job is still looked up first


async def test_a_store_refusing_the_caller_is_the_deployments_fault(stack: Stack, pki_dir: Path) -> None:
    """The client's mapping of the store's refusals, on a real channel: a principal the store binds to no team
    (the tool `ops`) is refused with PERMISSION_DENIED, which must not reach a user as their 403."""
    pki.ensure(pki_dir, [identity.tool("ops")])
    channels = Channels(pki.files_for(pki_dir, identity.tool("ops")))
    address = f"127.0.0.1:{stack.store.grpc_port}"
    client = CheckpointStoreClient(lambda: channels.get(address, identity.CHECKPOINT_STORE), timeout_s=10)
    try:
        with pytest.raises(Unavailable, match=r"refused the gateway .*may not act for team 'vision'.*deployment"):
            await client.list("job-any", team="vision", page_size=10, page_token="")
        with pytest.raises(NotFound):  # a gateway's refusal of a checkpoint stays NotFound
            gateway_channels = Channels(pki.files_for(pki_dir, identity.GATEWAY))
            try:
                gateway = CheckpointStoreClient(lambda: gateway_channels.get(address, identity.CHECKPOINT_STORE),
                                                timeout_s=10)
                await gateway.get("ckpt-0000nothere", team="vision")
            finally:
                await gateway_channels.close()
    finally:
        await channels.close()


# --- audit ------------------------------------------------------------------------------------------------------

async def test_changes_are_audited_under_the_jobs_team(stack: Stack) -> None:
    gw = stack.gateway
    async with alices_job(stack) as (alice, job, worker):
        ckpt = await worker.save(10)
        await worker.save(20)
    viewer = await gw.create_token("vision", "vic", role="viewer")
    assert gw.app._store is not None
    log = AuditLog(gw.app._store, gw.app.settings.etcd_prefix)
    rows = [  # token, method, suffix, result
        (gw.admin_token, "PUT", f"/{ckpt.id}/tags/best", "ok"),
        (alice, "DELETE", f"/{ckpt.id}", "failed_precondition"),
        (viewer, "DELETE", f"/{ckpt.id}/tags/best", "permission_denied"),
        (alice, "DELETE", f"/{ckpt.id}/tags/best", "ok"),
        (alice, "DELETE", f"/{ckpt.id}", "ok"),
    ]
    for token, method, suffix, result in rows:
        request_id = f"t-{uuid.uuid4().hex[:12]}"
        async with gw.client(token) as http:
            reply = await http.request(method, path(job["id"], suffix), headers={"X-Request-Id": request_id})
        entries = (await log.query(AuditFilter(request_id=request_id))).entries
        [mine] = [e for e in entries if e.service == "gateway"]
        route = "/v1/jobs/{job_id}/checkpoints/{checkpoint_id}" + ("/tags/{tag}" if "/tags/" in suffix else "")
        assert (mine.action, mine.target, mine.result) == (f"{method} {route}", f"checkpoint/{ckpt.id}", result), \
            reply.text
        assert mine.detail["job"] == job["id"] and mine.detail.get("tag") == ("best" if "/tags/" in suffix else None)
        assert mine.team == "vision"  # the operator's too: the answer names the job's team
    reads = (await log.query(AuditFilter(target=f"checkpoint/{ckpt.id}"), page_size=100)).entries
    assert len([e for e in reads if e.service == "gateway"]) == len(rows)  # GETs are not audited
    # The checkpoint-store recorded the same calls under the same request ids, naming the checkpoint alike.
    assert {e.service for e in reads} == {"gateway", "checkpoint-store"}


async def test_reads_are_not_audited(stack: Stack) -> None:
    gw: RunningGateway = stack.gateway
    async with alices_job(stack) as (alice, job, worker):
        ckpt = await worker.save(10)
    assert gw.app._store is not None
    log = AuditLog(gw.app._store, gw.app.settings.etcd_prefix)
    before = len((await log.query(AuditFilter(), page_size=500)).entries)
    async with gw.client(alice) as http:
        for where in (path(job["id"]), path(job["id"], f"/{ckpt.id}"), path(job["id"], f"/{ckpt.id}/manifest")):
            assert (await http.get(where)).status_code == 200
    assert len((await log.query(AuditFilter(), page_size=500)).entries) == before
