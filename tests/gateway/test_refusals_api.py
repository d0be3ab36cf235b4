"""Two refusals of a real gateway that need a real fault to provoke, through HTTP and the SDK:

- 507 `insufficient_storage`: etcd at its space quota (16 MiB `--quota-backend-bytes`, filled outside the
  deployment's prefix) refuses the submit; reads go on; the SDK raises InsufficientStorage.
- 409 `conflict`: an idempotency key whose job is neither in etcd nor in a history store (the deployment has
  none, and the job's record was removed behind its back) cannot be answered, and says to use a new key.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.core.test_etcd_nospace import fill, small_etcd  # noqa: F401 - the fixture
from tests.gateway.support import running_cluster, running_gateway
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing import etcd as etcd_proc
from trainyard_core.testing.etcd_secure import settings_of
from trainyard_sdk import AsyncClient, Conflict, InsufficientStorage

SPEC: dict[str, Any] = {"name": "it", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}


async def test_a_full_etcd_answers_507_to_a_submit_and_reads_go_on(small_etcd: etcd_proc.EtcdProcess,  # noqa: F811
                                                                     tmp_path: Any) -> None:
    etcd = settings_of(EtcdOptions(endpoints=small_etcd.endpoint))
    async with running_cluster(etcd=etcd, prefix="/nospace", state_root=tmp_path / "nodes") as cluster, \
            running_gateway(etcd=etcd, etcd_prefix=cluster.settings.etcd_prefix,
                            scheduler_address=cluster.address) as gw:
        token = await gw.create_token("vision", "alice")
        async with gw.client(token) as http:
            before = await http.post("/v1/jobs", json=SPEC)
            assert before.status_code == 201, before.text
            store = EtcdStore(small_etcd.endpoint)
            try:
                await fill(store)
            finally:
                await store.close()
            refused = await http.post("/v1/jobs", json=SPEC)
            assert refused.status_code == 507, refused.text
            error = refused.json()["error"]
            assert error["code"] == "insufficient_storage" and "etcd is out of space" in error["message"]
            assert "retry-after" not in refused.headers  # not a wait: an operator must free space
            assert (await http.get(f"/v1/jobs/{before.json()['id']}")).status_code == 200
            assert [j["id"] for j in (await http.get("/v1/jobs")).json()["jobs"]] == [before.json()["id"]]
        async with AsyncClient(gw.url, token=token) as sdk:
            with pytest.raises(InsufficientStorage) as raised:
                await sdk.submit_job(SPEC)
            assert raised.value.code == "insufficient_storage" and raised.value.status == 507


async def test_an_idempotency_key_whose_job_is_gone_everywhere_answers_409(etcd_settings: dict[str, str],
                                                                            key_prefix: str, tmp_path: Any) -> None:
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "gone", state_root=tmp_path / "n") as cluster, \
            running_gateway(etcd=etcd_settings, etcd_prefix=cluster.settings.etcd_prefix,
                            scheduler_address=cluster.address) as gw:
        token = await gw.create_token("vision", "alice")
        key = {"Idempotency-Key": "nightly-2026-12-05"}
        async with gw.client(token) as http:
            first = await http.post("/v1/jobs", json=SPEC, headers=key)
            assert first.status_code == 201, first.text
            job_id = first.json()["id"]
            # The job's record leaves etcd, as a finished one does after its TTL, with no history store to keep it.
            store = cluster.scheduler.store
            assert await store.delete(cluster.scheduler.keys.job(job_id))
            again = await http.post("/v1/jobs", json=SPEC, headers=key)
            assert again.status_code == 409, again.text
            error = again.json()["error"]
            assert error["code"] == "conflict" and job_id in error["message"] and "use a new key" in error["message"]
        async with AsyncClient(gw.url, token=token) as sdk:
            with pytest.raises(Conflict) as raised:
                await sdk.submit_job(SPEC, idempotency_key=key["Idempotency-Key"])
            assert raised.value.status == 409 and job_id in str(raised.value)
