"""CLI fixtures: the CLI runs in a worker thread (it is synchronous) against a real gateway on a free port,
backed by a stub scheduler over real gRPC. The environment is cleared of TRAINYARD_* and the working
directory is a fresh temporary one, so no developer's .trainyard/local.env leaks in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainyard_cli.main import main
from trainyard_gateway.testing import RunningGateway, StubScheduler, running_gateway


@dataclass
class Result:
    rc: int
    out: str
    err: str


class Cli:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys

    async def __call__(self, *argv: str) -> Result:
        self._capsys.readouterr()
        rc = await asyncio.to_thread(main, list(argv))
        captured = self._capsys.readouterr()
        return Result(rc, captured.out, captured.err)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("TRAINYARD_URL", "TRAINYARD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(capsys)


@pytest.fixture
async def stub_scheduler() -> AsyncIterator[StubScheduler]:
    stub = StubScheduler()
    await stub.start()
    try:
        yield stub
    finally:
        await stub.stop()


@pytest.fixture
async def gateway(etcd_endpoint: str, key_prefix: str, stub_scheduler: StubScheduler,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunningGateway]:
    """A gateway the CLI finds through TRAINYARD_URL / TRAINYARD_TOKEN (the bootstrap admin token)."""
    async with running_gateway(etcd_endpoints=etcd_endpoint, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=stub_scheduler.address) as gw:
        monkeypatch.setenv("TRAINYARD_URL", gw.url)
        monkeypatch.setenv("TRAINYARD_TOKEN", gw.admin_token)
        yield gw
