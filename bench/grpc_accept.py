"""How grpc.aio accepts a burst of calls of one method on a busy event loop (docs/architecture.md, "A burst of
calls of one method").

A grpc.aio server runs in its own process (`_accept_server.py`); a client in this process sends `calls`
concurrent unary calls of one method (the standard health Check, so nothing but the accept and the handler's
start is measured) and the server records when each handler starts. Twice: with the server's loop idle, and
with `busy` background tasks on it, each burning `burn_us` of CPU per step (a loop that does a few
milliseconds of other work per turn, as a leader's does under load).

Figures: `accept_gap_ms_idle` and `accept_gap_ms_busy` (the mean time between two handlers' starts),
`accept_span_ms_idle` / `_busy` (the first start to the last), `accept_gap_busy_vs_loop_turn_ms` (the busy gap
over one turn of the loop's background work, `busy` x `burn_us`: how many turns a call's accept takes),
`calls`, `busy`, `burn_us`. No target: this measures the library, so the scheduler's design can account for it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True)
class Config:
    calls: int = 100
    busy: int = 10
    burn_us: float = 300.0


TINY = Config(calls=10, busy=2, burn_us=100.0)


async def _burst(port: int, calls: int, server: subprocess.Popen[str]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)  # connected, and the method warm
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write("go\n")
        server.stdin.flush()
        ready = await asyncio.to_thread(server.stdout.readline)
        if ready.strip() != "ready":
            raise RuntimeError(f"the accept server said {ready!r}, not 'ready'")
        await asyncio.gather(*(stub.Check(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(calls)))


def _starts(config: Config, busy: int) -> list[float]:
    server = subprocess.Popen([sys.executable, "-m", "bench._accept_server", str(config.calls), str(busy),
                               str(config.burn_us)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        asyncio.run(_burst(port, config.calls, server))
        starts = sorted(float(t) for t in json.loads(server.stdout.readline()))
        assert server.stdin is not None
        server.stdin.write("done\n")
        server.stdin.flush()
    finally:
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    if len(starts) < config.calls:
        raise RuntimeError(f"{len(starts)} of {config.calls} calls reached the handler")
    return starts


def run(config: Config = Config()) -> dict[str, float]:
    figures: dict[str, float] = {"calls": config.calls, "busy": config.busy, "burn_us": config.burn_us}
    for label, busy in (("idle", 0), ("busy", config.busy)):
        starts = _starts(config, busy)
        span = starts[-1] - starts[0]
        figures[f"accept_span_ms_{label}"] = span * 1e3
        figures[f"accept_gap_ms_{label}"] = span / (len(starts) - 1) * 1e3
    turn_ms = config.busy * config.burn_us / 1e3
    figures["accept_gap_busy_vs_loop_turn_ms"] = figures["accept_gap_ms_busy"] / turn_ms if turn_ms else 0.0
    return figures
