"""One scheduler leader for bench/history, in a process of its own: `python -m bench._history_leader SETTINGS`.

It runs what `python -m trainyard_scheduler` runs (`SchedulerApp` with the scheduler's settings, garbage
collector tuned by `gc_tuning`, JSON logs at INFO to stderr), with one difference: the node agents are a
stand-in that accepts every launch and stop at once (`_AcceptingAgents`), so the leader's gangs start and stay
running without processes behind them. Nodes are registered in etcd by the parent and count as alive through
the leader's start-up grace (`leader_grace_s`, set long by the parent): nothing sends heartbeats.

The parent talks to it over stdin and stdout, one JSON request and one JSON answer a line:

    {"op": "cycles", "s": S}   the duration of every reconcile cycle the leader's own loop ran in the next S
                               seconds (the loop's `cycle` timed around; nothing else changes)
    {"op": "status"}           jobs in the leader's view by state, archiving counters, keys in its mirror
    {"op": "stop"}             stop the app and exit

The first line it writes is {"port": P} once it leads (P: its gRPC port).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from trainyard_core import gc_tuning, logs
from trainyard_scheduler import metrics
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.domain.models import Node
from trainyard_scheduler.launch import NodeLaunch
from trainyard_scheduler.reconcile import Reconciler
from trainyard_scheduler.settings import SchedulerSettings


class _AcceptingAgents:
    """Every node's agent, answering at once: the launch happened, the stop happened."""

    async def launch(self, node: Node, launch: NodeLaunch, epoch: int) -> None:
        return None

    async def stop(self, node: Node, job_id: str, attempt: int, grace_s: float, reason: str, epoch: int,
                   signal: str = "") -> None:
        return None


class _CycleTimer:
    """Times the cycles a reconciler's own loop runs (its `cycle`, wrapped on the instance)."""

    def __init__(self) -> None:
        self.samples: list[float] | None = None
        self._wrapped: Reconciler | None = None

    def attach(self, reconciler: Reconciler) -> None:
        if reconciler is self._wrapped:
            return
        inner: Callable[[], Awaitable[None]] = reconciler.cycle

        async def timed() -> None:
            began = time.perf_counter()
            try:
                await inner()
            finally:
                if self.samples is not None:
                    self.samples.append(time.perf_counter() - began)

        reconciler.cycle = timed  # type: ignore[method-assign]
        self._wrapped = reconciler


def _counter(c: object) -> float:
    return float(sum(s.value for m in c.collect() for s in m.samples if s.name.endswith("_total")))  # type: ignore[attr-defined]


async def _answer(app: SchedulerApp, timer: _CycleTimer, request: dict[str, object]) -> dict[str, object]:
    op = request["op"]
    if op == "cycles":
        assert app.reconciler is not None, "not leading"
        timer.attach(app.reconciler)
        timer.samples = []
        await asyncio.sleep(float(request["s"]))  # type: ignore[arg-type]
        samples, timer.samples = timer.samples, None
        return {"cycles": samples}
    if op == "status":
        states = {s: metrics.JOBS.labels(s)._value.get()
                  for s in ("pending", "admitted", "running", "preempted", "restarting")}
        return {"jobs": states, "archived": _counter(metrics.HISTORY_ARCHIVED),
                "expired": _counter(metrics.JOBS_EXPIRED), "backlog": metrics.HISTORY_BACKLOG._value.get(),
                "mirror_keys": len(app._mirror.items), "leading": app.leadership.is_leader}
    raise ValueError(f"unknown op {op!r}")


async def _serve(settings: SchedulerSettings) -> None:
    gc_tuning.tune()
    app = SchedulerApp(settings, agents=_AcceptingAgents())
    await app.start()
    try:
        while app.reconciler is None or not app.leadership.is_leader:  # noqa: ASYNC110 - nothing to wait on
            await asyncio.sleep(0.05)
        timer = _CycleTimer()
        timer.attach(app.reconciler)
        out = sys.stdout
        out.write(json.dumps({"port": app.grpc_port}) + "\n")
        out.flush()
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            request = json.loads(line)
            if request["op"] == "stop":
                break
            out.write(json.dumps(await _answer(app, timer, request)) + "\n")
            out.flush()
    finally:
        await app.stop()


def main(argv: list[str]) -> int:
    settings = SchedulerSettings.model_validate(json.loads(Path(argv[0]).read_text()))
    logs.setup_logging("scheduler", "INFO", "json")
    asyncio.run(_serve(settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
