"""CLI fixtures: the CLI runs in a worker thread (it is synchronous) against a real gateway on a free port,
backed by a real scheduler with no nodes (tests that need nodes add real agents to it). The environment
is cleared of TRAINYARD_* and the working directory is a fresh temporary one, so no developer's
.trainyard/local.env leaks in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gateway.support import Cluster, RunningGateway, running_cluster, running_gateway
from trainyard_cli.main import main


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
    for name in ("TRAINYARD_URL", "TRAINYARD_TOKEN", "TRAINYARD_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(capsys)


@pytest.fixture
async def scheduler(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    """A real scheduler of its own per test (about 0.1 s), so `trainyard jobs` as admin sees only this
    test's jobs; no nodes until the test adds agents."""
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "scheduler",
                               state_root=tmp_path / "nodes") as cluster:
        yield cluster


@pytest.fixture
async def gateway(etcd_settings: dict[str, str], key_prefix: str, scheduler: Cluster,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunningGateway]:
    """A gateway the CLI finds through TRAINYARD_URL / TRAINYARD_TOKEN (the bootstrap operator token)."""
    # One deployment, one prefix: the gateway's audit entries are where the scheduler's AuditService reads.
    async with running_gateway(etcd=etcd_settings, etcd_prefix=scheduler.settings.etcd_prefix,
                               scheduler_address=scheduler.address) as gw:
        monkeypatch.setenv("TRAINYARD_URL", gw.url)
        monkeypatch.setenv("TRAINYARD_TOKEN", gw.admin_token)
        yield gw
