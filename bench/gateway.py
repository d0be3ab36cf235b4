"""The gateway's public API under 100 concurrent clients, beside a bare FastAPI endpoint in the same run.

A local cluster (real etcd, scheduler with its history store, gateway, one simulated 8-GPU node), mTLS on as
in production, holds `jobs` jobs of team `bench` (8 running, the rest pending: the node has 8 GPUs). Each of
`clients` closed-loop clients (aiohttp, one connection each, keep-alive) has its own member token of that
team (the gateway rate-limits per token; one shared token would measure the limiter) and sends its next
request as soon as the last one answered, for `duration_s` per phase after `warmup_s`:

- `hello`: `GET /hello` of a bare FastAPI app served by uvicorn in its own process (the same venv, uvicorn,
  its HTTP parser (httptools) and FastAPI as the gateway, no middleware, no auth): the framework's own floor on
  this machine, now.
- `get`: `GET /v1/jobs/{id}` of a random job of the team (team-scoped, as every non-operator's read).
- `list`: `GET /v1/jobs?page_size=50` (the team's newest 50, live and finished merged).
- `submit`: `POST /v1/jobs` of a one-GPU job, `submits` of them in all (they stay pending), last, so the
  reads ran over the seeded set only.

Figures: `hello_p95_ms`, `hello_throughput_rps`, `get_p95_ms`, `get_throughput_rps`, `list_p95_ms`,
`list_throughput_rps`, `submit_p99_ms`, `submit_throughput_rps`, `errors` (answers other than 200/201 and
failed requests, every phase), and the ratios against hello: `get_throughput_vs_hello` (target >= 0.5),
`get_p95_vs_hello` (target <= 2), `list_throughput_vs_hello`, `list_p95_vs_hello`.

How to read them: this machine has 2 cores, and the load generator (this process, one asyncio loop) shares
them with what it measures. During `hello` the CPUs are split between the generator and one uvicorn process;
during `get` and `list` between the generator, the gateway, and whatever the gateway calls (the scheduler,
etcd). So absolute figures say little (the machine is shared and noisy, 3x between runs); the ratios to hello
measured minutes apart in the same run are the figures to compare, and a read path that leaves the gateway
(a scheduler round trip per request) shows up in them twice: in its own latency, and in the CPU it takes
from the generator and the gateway.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from trainyard_cli.local import LocalCluster
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import until

TEAM = "bench"
SLEEP = [sys.executable, "-c", "import time; time.sleep(86400)"]
WAIT = [sys.executable, "-c", "pass"]

# The bare endpoint: the same framework and server as the gateway, nothing else.
HELLO_APP = """
import asyncio, sys
import uvicorn
from fastapi import FastAPI

app = FastAPI()

@app.get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "world"}

config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), http="httptools", log_config=None,
                        access_log=False, lifespan="off", server_header=False)
asyncio.run(uvicorn.Server(config).serve())
"""


@dataclass(frozen=True)
class Config:
    clients: int = 100
    jobs: int = 300
    duration_s: float = 10.0
    warmup_s: float = 2.0
    submits: int = 1000
    page_size: int = 50
    # False: the gateway's job_view setting off, every read a round trip to the scheduler (the path before the
    # view; BENCH_GATEWAY_JOB_VIEW=false measures it).
    job_view: bool = True


TINY = Config(clients=4, jobs=6, duration_s=0.5, warmup_s=0.2, submits=8, page_size=2)


@dataclass
class Phase:
    """What the clients of one phase saw: a latency per answered request (seconds) and the failures."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed_s: float = 0.0
    first_error: str = ""

    def pct_ms(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.elapsed_s if self.elapsed_s else float("nan")


# One request of a client, given its session and its random source: the status and the start of the body.
Request = Callable[[aiohttp.ClientSession, random.Random], Awaitable[tuple[int, str]]]


async def _closed_loop(sessions: list[aiohttp.ClientSession], request: Request, *, duration_s: float,
                       warmup_s: float, count: int = 0) -> Phase:
    """Every session sends `request` in a loop, the next as soon as the last answered: for `warmup_s`
    unrecorded, then for `duration_s` recorded; or, with `count`, that many in all, every one recorded."""
    phase = Phase()
    started = time.perf_counter()
    measure_from = started if count else started + warmup_s
    stop_at = measure_from + duration_s
    left = count

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal left
        rng = random.Random(i)
        while True:
            if count:
                if left <= 0:
                    return
                left -= 1
            elif time.perf_counter() >= stop_at:
                return
            t0 = time.perf_counter()
            try:
                status, body = await request(session, rng)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, body = -1, f"{type(exc).__name__}: {exc}"
            took = time.perf_counter() - t0
            if t0 < measure_from:
                continue
            if status in (200, 201):
                phase.latencies.append(took)
            else:
                phase.errors += 1
                phase.first_error = phase.first_error or f"status {status}: {body}"

    await asyncio.gather(*(client(i, s) for i, s in enumerate(sessions)))
    phase.elapsed_s = time.perf_counter() - measure_from
    return phase


def _get(url: str) -> Request:
    async def call(session: aiohttp.ClientSession, rng: random.Random) -> tuple[int, str]:
        async with session.get(url) as r:
            body = await r.read()
            return r.status, body[:200].decode(errors="replace")
    return call


def _get_random(base: str, paths: list[str]) -> Request:
    async def call(session: aiohttp.ClientSession, rng: random.Random) -> tuple[int, str]:
        async with session.get(base + rng.choice(paths)) as r:
            body = await r.read()
            return r.status, body[:200].decode(errors="replace")
    return call


def _submit(url: str) -> Request:
    async def call(session: aiohttp.ClientSession, rng: random.Random) -> tuple[int, str]:
        spec = {"name": f"load-{rng.randrange(1 << 30)}", "command": WAIT, "resources": {"nodes": 1,
                                                                                        "gpus_per_node": 1}}
        async with session.post(url + "/v1/jobs", json=spec) as r:
            body = await r.read()
            return r.status, body[:200].decode(errors="replace")
    return call


def _sessions(n: int, tokens: list[str] | None = None) -> list[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=30)
    out = []
    for i in range(n):
        headers = {"Authorization": f"Bearer {tokens[i % len(tokens)]}"} if tokens else {}
        out.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, force_close=False),
                                         headers=headers, timeout=timeout))
    return out


async def _close(sessions: list[aiohttp.ClientSession]) -> None:
    await asyncio.gather(*(s.close() for s in sessions))


async def _seed(url: str, admin: str, config: Config) -> tuple[list[str], list[str]]:
    """`clients` member tokens of TEAM and `jobs` jobs submitted with them: 8 that run (they hold the node's 8
    GPUs), the rest pending. Returns (tokens, job ids)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin}"}) as http:
        async def token(i: int) -> str:
            async with http.post(url + "/v1/tokens", json={"team": TEAM, "user": f"user-{i}",
                                                           "role": "member"}) as r:
                assert r.status == 201, await r.text()
                return str((await r.json())["secret"])
        tokens = list(await asyncio.gather(*(token(i) for i in range(config.clients))))
    sessions = _sessions(min(config.clients, 16), tokens)
    try:
        async def submit(i: int) -> str:
            spec = {"name": f"seed-{i}", "command": SLEEP if i < 8 else WAIT,
                    "resources": {"nodes": 1, "gpus_per_node": 1}, "labels": {"project": f"p{i % 5}"}}
            async with sessions[i % len(sessions)].post(url + "/v1/jobs", json=spec) as r:
                assert r.status == 201, await r.text()
                return str((await r.json())["id"])
        ids = []
        for start in range(0, config.jobs, 64):
            ids += await asyncio.gather(*(submit(i) for i in range(start, min(config.jobs, start + 64))))
    finally:
        await _close(sessions)
    return tokens, ids


async def _measure(url: str, hello_url: str, admin: str, config: Config) -> dict[str, float]:
    tokens, ids = await _seed(url, admin, config)
    phases: dict[str, Phase] = {}
    plan: list[tuple[str, str, Request, int]] = [
        ("hello", "", _get(hello_url + "/hello"), 0),
        ("get", url, _get_random(url, [f"/v1/jobs/{j}" for j in ids]), 0),
        ("list", url, _get(url + f"/v1/jobs?page_size={config.page_size}"), 0),
        ("submit", url, _submit(url), config.submits),
    ]
    for name, base, request, count in plan:
        sessions = _sessions(config.clients, tokens if base else None)
        try:
            phases[name] = await _closed_loop(sessions, request, duration_s=config.duration_s,
                                              warmup_s=config.warmup_s, count=count)
        finally:
            await _close(sessions)
        if phases[name].errors:
            print(f"  {name}: {phases[name].errors} errors, the first: {phases[name].first_error}", flush=True)
    hello, get, lst, submit = (phases[n] for n in ("hello", "get", "list", "submit"))
    return {
        "hello_p95_ms": hello.pct_ms(0.95),
        "hello_throughput_rps": hello.throughput,
        "get_p50_ms": get.pct_ms(0.5),
        "get_p95_ms": get.pct_ms(0.95),
        "get_throughput_rps": get.throughput,
        "list_p50_ms": lst.pct_ms(0.5),
        "list_p95_ms": lst.pct_ms(0.95),
        "list_throughput_rps": lst.throughput,
        "submit_p50_ms": submit.pct_ms(0.5),
        "submit_p99_ms": submit.pct_ms(0.99),
        "submit_throughput_rps": submit.throughput,
        "errors": float(sum(p.errors for p in phases.values())),
        "get_throughput_vs_hello": get.throughput / hello.throughput,
        "get_p95_vs_hello": get.pct_ms(0.95) / hello.pct_ms(0.95),
        "list_throughput_vs_hello": lst.throughput / hello.throughput,
        "list_p95_vs_hello": lst.pct_ms(0.95) / hello.pct_ms(0.95),
        "clients": float(config.clients),
        "jobs": float(len(ids)),
        "submits": float(len(submit.latencies) + submit.errors),
        "job_view": float(config.job_view),
    }


def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    import httpx

    def answers() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code < 500
        except httpx.HTTPError:
            return False
    until(answers, timeout_s, f"{url} to answer", interval=0.05)


def _wait_node(url: str, token: str) -> None:
    import httpx

    def ready() -> bool:
        r = httpx.get(url + "/v1/nodes", headers={"Authorization": f"Bearer {token}"}, timeout=5.0)
        return r.status_code == 200 and any(n.get("state") == "ready" for n in r.json().get("nodes", []))
    until(ready, 60.0, "the node to be ready")


class _Cluster(LocalCluster):
    """The local cluster, with the gateway's job_view setting as the benchmark asks."""

    def __init__(self, workdir: Path, *, job_view: bool) -> None:
        super().__init__(workdir, gateway_port=0, nodes=[("node-1", "h100x8")], tls=True)
        self._job_view = job_view

    def _proc(self, name: str, module: str, env_prefix: str, settings: dict[str, str]) -> Any:
        proc = super()._proc(name, module, env_prefix, settings)
        if name == "gateway":
            proc.env["TRAINYARD_GATEWAY_JOB_VIEW"] = "true" if self._job_view else "false"
        return proc


def run(config: Config = Config()) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        cluster = _Cluster(Path(tmp) / "cluster", job_view=config.job_view)
        hello = subprocess.Popen([sys.executable, "-c", HELLO_APP, str(port)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            cluster.start()
            _wait_http(f"http://127.0.0.1:{port}/hello")
            _wait_node(cluster.url, cluster.token)
            figures = asyncio.run(_measure(cluster.url, f"http://127.0.0.1:{port}", cluster.token, config))
        finally:
            hello.terminate()
            try:
                hello.wait(10)
            except subprocess.TimeoutExpired:
                hello.kill()
            cluster.stop()
    return figures
