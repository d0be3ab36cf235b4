"""Listings as iterators across the API's pages, with both clients: every item once, in the API's order, one
request per page; stable while the listing changes (a job submitted meanwhile does not shift the pages after
the first); the audit log's pages, which may hold fewer entries than asked while more follow."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.gateway.support import Cluster, RunningGateway
from trainyard_core.testing.wait import eventually

from .support import Api, Sdk, Sent

SPEC: dict[str, Any] = {"command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}


def submit(name: str) -> Callable[[Any], Any]:
    return lambda c: c.submit_job({**SPEC, "name": name})


async def test_every_job_once_newest_first_one_request_per_page(sdk: Sdk, live_gateway: RunningGateway,
                                                                scheduler: Cluster) -> None:
    token = await live_gateway.create_token("vision", "alice")
    api = sdk(live_gateway.url, token)
    submitted = [(await api(submit(f"j{i}"))).id for i in range(7)]
    sent: list[Sent] = []
    paged = sdk(live_gateway.url, token, transport=sdk.recording(sent))
    listed = [j.id for j in await paged(lambda c: c.list_jobs(page_size=3))]
    assert listed == submitted[::-1]
    assert [s.path for s in sent] == ["/v1/jobs"] * 3  # 3 + 3 + 1
    assert [j.id for j in await paged(lambda c: c.list_jobs(page_size=7))] == listed
    assert [j.name for j in await paged(lambda c: c.list_jobs(page_size=2, name_prefix="j6"))] == ["j6"]


async def test_a_job_submitted_while_paging_does_not_shift_the_pages(sdk: Sdk, live_gateway: RunningGateway,
                                                                     scheduler: Cluster) -> None:
    api = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    old = [(await api(submit(f"old{i}"))).id for i in range(5)]
    seen = await _list_submitting_midway(api, page_size=2, after=2, spec={**SPEC, "name": "new"})
    assert seen == old[::-1]  # each old job once, none skipped, the new one not among them
    fresh = [j.name for j in await api(lambda c: c.list_jobs(page_size=2))]
    assert fresh == ["new", *[f"old{i}" for i in range(4, -1, -1)]]  # a fresh listing starts with it


async def _list_submitting_midway(api: Api, *, page_size: int, after: int, spec: dict[str, Any]) -> list[str]:
    """The ids a listing iterates over when a job is submitted (by the same client) after its first `after`."""
    if api.is_async:
        client: Any = api.client
        out: list[str] = []
        async for job in client.list_jobs(page_size=page_size):
            out.append(job.id)
            if len(out) == after:
                await client.submit_job(spec)
        return out

    def walk(client: Any) -> list[str]:
        ids: list[str] = []
        for job in client.list_jobs(page_size=page_size):
            ids.append(job.id)
            if len(ids) == after:
                client.submit_job(spec)
        return ids

    result: list[str] = await api(walk)
    return result


async def test_the_audit_log_across_pages(sdk: Sdk, live_gateway: RunningGateway, scheduler: Cluster) -> None:
    alice = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    jobs = [(await alice(submit(f"a{i}"))).id for i in range(5)]
    operator = sdk(live_gateway.url, live_gateway.admin_token)

    async def gateway_entries() -> list[Any]:
        entries: list[Any] = await operator(lambda c: c.audit(user="alice", action="POST /v1/jobs", page_size=2))
        return entries if len(entries) == 5 else []

    entries = await eventually(gateway_entries, what="alice's five submits in the audit log")
    assert [e.target for e in entries] == [f"job/{j}" for j in reversed(jobs)]  # newest first
    assert len({e.id for e in entries}) == 5
    page = await operator(lambda c: c.audit_page(user="alice", action="POST /v1/jobs", page_size=2))
    assert len(page.entries) <= 2 and page.next_page_token
