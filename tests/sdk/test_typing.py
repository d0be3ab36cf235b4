"""The one table of methods is typed for each client: mypy (the project's configuration) sees a `Job` from
`Client.get_job`, a coroutine of one from `AsyncClient.get_job`, iterators from listings and event streams of
the gateway's event models from streams, and refuses wrong arguments."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[2]

PROBE = """\
from trainyard_sdk import AsyncClient, Client


def sync(c: Client) -> None:
    reveal_type(c.get_job("x"))
    reveal_type(c.list_jobs(state="failed"))
    reveal_type(c.follow_logs("x"))
    reveal_type(c.list_nodes())
    c.get_job(3)


async def aio(c: AsyncClient) -> None:
    reveal_type(c.get_job("x"))  # unawaited, on purpose
    reveal_type(c.list_jobs())
    reveal_type(c.watch_jobs())
    c.list_jobs(nodes=2)
"""


def test_each_client_sees_its_own_types(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(PROBE))
    out, err, _ = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary", str(probe)])
    notes = re.findall(r'Revealed type is "(.*)"', out)
    errors = [line.split(": error: ", 1)[1] for line in out.splitlines() if ": error: " in line]
    assert notes == [
        "trainyard_gateway.schemas.jobs.Job",
        "typing.Iterator[trainyard_gateway.schemas.jobs.Job]",
        "trainyard_sdk.streaming.EventStream[trainyard_gateway.schemas.logs.LineEvent | "
        "trainyard_gateway.schemas.logs.WarningEvent | trainyard_gateway.schemas.logs.EndEvent]",
        "list[trainyard_gateway.schemas.nodes.Node]",
        "typing.Coroutine[Any, Any, trainyard_gateway.schemas.jobs.Job]",
        "typing.AsyncIterator[trainyard_gateway.schemas.jobs.Job]",
        "trainyard_sdk.streaming.AsyncEventStream[trainyard_sdk.streams.JobsSnapshot | "
        "trainyard_sdk.streams.JobChanged]",
    ], out + err
    assert len(errors) == 3, out
    assert 'Argument 1 has incompatible type "int"; expected "str"' in errors[0]
    assert 'Value of type "Coroutine[Any, Any, Job]" must be used' in errors[1]  # a forgotten await is caught
    assert 'Unexpected keyword argument "nodes"' in errors[2]
