"""The CLI on the SDK (trainyard_cli.api over trainyard_sdk.Client), against a real gateway: `--json` prints what
the gateway answered, byte for byte as JSON values; an HTTPS gateway is reached through TRAINYARD_CA_BUNDLE (or
`--ca-bundle`) as the SDK reaches it; a stream whose first connection fails fails at once; and the CLI's
messages for the SDK's failures (`message_of`, pure)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_follow import CuttingForwarder
from tests.gateway.support import Cluster, RunningGateway, python, running_gateway
from trainyard.common.v1 import types_pb2
from trainyard_cli import api
from trainyard_cli.api import message_of
from trainyard_core.security import identity, pki
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually
from trainyard_sdk import ConnectionFailed, NotFound, Reconnect, Target, Unauthenticated


async def test_json_output_is_the_gateways_answer(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    r = await cli("submit", "--name", "sleeper", "--gpus-per-node", "2", "--json", "--",
                  *python("import time; time.sleep(120)"))
    assert r.rc == 0, r.err
    job_id = json.loads(r.out)["id"]
    await scheduler.wait_state(job_id, types_pb2.JOB_STATE_RUNNING)  # then it stays as it is while compared
    r = await cli("quotas", "set", "vision", "--limit", "*=8", "--json")
    assert r.rc == 0, r.err
    async with gateway.client(gateway.admin_token) as http:
        for argv, path in ((("status", job_id), f"/v1/jobs/{job_id}"), (("nodes",), "/v1/nodes"),
                           (("queues",), "/v1/queues"), (("quotas", "get", "vision"), "/v1/quotas/vision"),
                           (("tokens", "list"), "/v1/tokens")):
            r = await cli(*argv, "--json")
            assert r.rc == 0, r.err
            answer = (await http.get(path)).json()
            printed = json.loads(r.out)
            if argv == ("nodes",):  # the heartbeat's time moves between the two reads; the rest must not
                for node in (*printed["nodes"], *answer["nodes"]):
                    assert node.pop("last_heartbeat")
            assert printed == answer, (argv, differences(printed, answer))


MISSING = "<missing>"


def differences(printed: Any, answer: Any, at: str = "") -> list[str]:
    """Where two JSON values differ (for the assertion's message)."""
    if isinstance(printed, dict) and isinstance(answer, dict):
        return [d for k in {*printed, *answer} for d in differences(printed.get(k, MISSING), answer.get(k, MISSING),
                                                                    f"{at}.{k}")]
    if isinstance(printed, list) and isinstance(answer, list) and len(printed) == len(answer):
        pairs = enumerate(zip(printed, answer, strict=True))
        return [d for i, (p, a) in pairs for d in differences(p, a, f"{at}[{i}]")]
    return [] if printed == answer else [f"{at}: printed {printed!r}, answered {answer!r}"]


@pytest.fixture
async def https_gateway(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> AsyncIterator[RunningGateway]:
    files = pki.files_for(pki_dir, identity.GATEWAY)
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}", http_tls_cert_file=str(files.cert),
                               http_tls_key_file=str(files.key)) as gw:
        yield gw


async def test_an_https_gateway_through_the_ca_bundle(cli: Any, https_gateway: RunningGateway, pki_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url = f"https://localhost:{https_gateway.app.http_port}"
    monkeypatch.setenv("TRAINYARD_URL", url)
    monkeypatch.setenv("TRAINYARD_TOKEN", https_gateway.admin_token)
    r = await cli("tokens", "list")
    assert r.rc == 1 and "certificate is not trusted" in r.err and "TRAINYARD_CA_BUNDLE" in r.err
    r = await cli("tokens", "list", "--ca-bundle", str(pki_dir / "ca.pem"))
    assert r.rc == 0, r.err
    monkeypatch.setenv("TRAINYARD_CA_BUNDLE", str(pki_dir / "ca.pem"))
    r = await cli("tokens", "list", "--json")
    assert r.rc == 0, r.err
    assert '"team": "admin"' in r.out
    (tmp_path / "not.pem").write_text("no certificate here")
    r = await cli("tokens", "list", "--ca-bundle", str(tmp_path / "not.pem"))
    assert r.rc == 2 and "not.pem: cannot be read as PEM certificates" in r.err


async def test_a_stream_whose_first_connection_fails_fails_at_once(cli: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (("logs", "-f", "job-x"), ("status", "--watch", "job-x")):
        r = await cli(*argv, "--url", url, "--token", "ty_x")
        assert r.rc == 1
        assert r.err.strip() == f"error: cannot reach the gateway at {url}: connection refused — is `make run` running?"


async def test_a_refused_stream_is_the_apis_message(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("logs", "-f", "job-does-not-exist")
    assert (r.rc, r.err.strip()) == (1, "error: job job-does-not-exist not found")
    r = await cli("status", "--watch", "job-does-not-exist")
    assert (r.rc, r.err.strip()) == (1, "error: job job-does-not-exist not found")


async def test_a_stream_lost_for_good_is_given_up(cli: Any, gateway: RunningGateway, scheduler: Cluster,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI's policy (9 reconnects, about 28 s) made short; the loop and its decisions are the same.
    monkeypatch.setattr(api, "RECONNECT", Reconnect(max_failures=3, backoff_s=0.01, max_delay_s=0.01))
    await scheduler.add_agent("node-a")
    job = await scheduler.submit(python("print('up', flush=True); import time; time.sleep(120)"), gpus=1)
    async with CuttingForwarder(gateway.app.http_port) as forwarder:
        follow = asyncio.create_task(cli("logs", job.id, "-f", "--url", forwarder.url))

        async def forwarded() -> bool:
            return forwarder.lines_forwarded >= 1

        await eventually(forwarded, timeout=30, what="the first line to be forwarded")
        forwarder.refuse()
        r = await asyncio.wait_for(follow, 30)
    assert r.rc == 1
    assert r.out.splitlines() == ["[rank 0] up"]
    assert r.err.count("; reconnecting") == 3
    assert r.err.splitlines()[-1] == (f"error: lost the stream from the gateway at {forwarder.url} (cannot reach the "
                                      f"gateway at {forwarder.url}: connection refused); gave up after 3 reconnects")


@pytest.mark.parametrize(("error", "message"), [
    (Unauthenticated(401, "unauthenticated", "invalid or revoked token"),
     "invalid or revoked token (token from environment variable TRAINYARD_TOKEN)"),
    (ConnectionFailed("cannot reach the gateway at http://h:1: connection refused", url="http://h:1", refused=True),
     "cannot reach the gateway at http://h:1: connection refused — is `make run` running?"),
    (ConnectionFailed("the gateway at http://h:1 did not answer within 30s", url="http://h:1", timed_out=True),
     "the gateway at http://h:1 did not answer within 30s"),
    (NotFound(404, "not_found", "job job-x not found"), "job job-x not found"),
])
def test_the_clis_message_for_each_failure(error: Any, message: str) -> None:
    target = Target(url="http://h:1", token="ty_x", url_source="--url",
                    token_source="environment variable TRAINYARD_TOKEN")
    assert message_of(error, target) == message
    if isinstance(error, Unauthenticated):
        assert message_of(error, Target(url="http://h:1", token="", token_source="")).endswith(
            "(token from nowhere)")
