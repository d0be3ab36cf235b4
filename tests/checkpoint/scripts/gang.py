"""Start gangs of real torch.distributed worker processes (gloo on loopback) the way Trainyard's node agent
does: the standard environment per rank, a free MASTER_PORT, each rank's output in its own log file.

Workers are forked by the zygote (zygote.py), which has torch already imported; `zygote` is the
session-wide fixture for it. Waits have deadlines; a gang that fails or times out is killed and the
error carries every rank's log.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainyard_core.testing.etcd import free_port

SCRIPTS = Path(__file__).resolve().parent
WORKER = SCRIPTS / "client_worker.py"


def job_env(store_address: str, job_id: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({"TRAINYARD_CHECKPOINT_STORE": store_address, "TRAINYARD_JOB_ID": job_id, "TRAINYARD_ATTEMPT": "0",
                "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                # The store of these tests serves plaintext (tests/checkpoint/test_job_credentials.py runs the
                # client with a job credential against an mTLS one).
                "TRAINYARD_CHECKPOINT_PLAINTEXT": "1"})
    env.update(extra)
    return env


@dataclass
class Exit:
    code: int | None  # None: killed by a signal
    signal: int | None


class Worker:
    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: Path) -> None:
        self.pid = pid
        self.log = log
        self._reader = reader
        self._writer = writer
        self.exit: Exit | None = None
        self._waiting: asyncio.Task[Exit] | None = None

    async def _read_exit(self) -> Exit:
        line = await self._reader.readline()
        self._writer.close()
        status = json.loads(line) if line else {"signal": -1}
        self.exit = Exit(status.get("exit"), status.get("signal"))
        return self.exit

    def wait(self) -> asyncio.Task[Exit]:
        """The worker's end (awaitable any number of times, from several places at once)."""
        if self._waiting is None:
            self._waiting = asyncio.ensure_future(self._read_exit())
        return self._waiting

    def kill(self) -> None:
        if self.exit is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self.path = str(tmp / "zygote.sock")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self._log = open(tmp / "zygote.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, str(SCRIPTS / "zygote.py"), self.path], env=env,
                                     stdout=subprocess.PIPE, stderr=self._log)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.stop()
            raise RuntimeError(f"the worker zygote did not start: {(tmp / 'zygote.log').read_text()[-4000:]}")

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: Path,
                    user: tuple[int, int] | None = None) -> Worker:
        """`user`: the (uid, gid) the worker runs as, as the agent's run_as would (the zygote must be root)."""
        reader, writer = await asyncio.open_unix_connection(self.path)
        request: dict[str, Any] = {"argv": list(argv), "env": dict(env), "log": str(log)}
        if user is not None:
            request["user"] = list(user)
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        answer = json.loads(await asyncio.wait_for(reader.readline(), 30))
        return Worker(answer["pid"], reader, writer, log)

    def stop(self) -> None:
        """Idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


_shared: list[Zygote] = []


@pytest.fixture(scope="session", name="zygote")
def zygote_fixture() -> Iterator[Zygote]:
    """One zygote for the whole session, whichever test modules import this fixture (each import is its
    own fixture definition to pytest, so the instance is shared here)."""
    if not _shared or _shared[0].proc.poll() is not None:
        _shared[:] = [Zygote(Path(tempfile.mkdtemp(prefix="trainyard-zygote-")))]
    try:
        yield _shared[0]
    finally:
        _shared[0].stop()


async def start_gang(zygote: Zygote, args: Sequence[str], *, world_size: int, env: Mapping[str, str],
                     out: Path, script: Path = WORKER, user: tuple[int, int] | None = None) -> list[Worker]:
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    port = free_port()
    workers = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                    "MASTER_PORT": str(port), "OUT": str(out)}
        workers.append(await zygote.spawn([str(script), *args], rank_env, out / f"rank{rank}.log", user))
    return workers


async def dump_stacks(workers: Sequence[Worker]) -> None:
    """Have every live worker write all its threads' Python stacks into its log (diagnostics of a hang)."""
    for w in workers:
        if w.exit is None:
            try:
                os.kill(w.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    # Best effort, for the error message only: give them a moment to write.
    await asyncio.sleep(1.0)


def logs_of(workers: Sequence[Worker]) -> str:
    return "\n".join(f"--- rank {r} ---\n{w.log.read_text(errors='replace')[-6000:]}"
                     for r, w in enumerate(workers))


async def run_gang(zygote: Zygote, args: Sequence[str], *, world_size: int, env: Mapping[str, str], out: Path,
                   timeout: float = 30.0, script: Path = WORKER, exit_code: int = 0,
                   reports: bool = True, user: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Run `script args` as ranks 0..world_size-1 to completion, each expected to exit with `exit_code`;
    every rank's `rank<N>.json` report, by rank (none when `reports` is False)."""
    workers = await start_gang(zygote, args, world_size=world_size, env=env, out=out, script=script, user=user)
    try:
        exits: list[Exit] | None = await asyncio.wait_for(asyncio.gather(*(w.wait() for w in workers)), timeout)
    except TimeoutError:
        exits = None
        await dump_stacks(workers)
    finally:
        for w in workers:
            w.kill()
    if exits is None or not all(e.code == exit_code for e in exits):
        what = f"timed out after {timeout}s" if exits is None else f"ended with {exits}"
        raise AssertionError(f"gang {' '.join(args)} (world size {world_size}) {what}\n{logs_of(workers)}")
    if not reports:
        return []
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
