"""Admission for a storm of calls (trainyard_core.rpc.admission): a bounded number run at once, callers whose
wait would be long are refused at once with successive appointments, and a refused call reaches the caller as
UNAVAILABLE with the appointment in its trailing metadata, unaudited (it did nothing)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_core.audit import AuditEntry
from trainyard_core.errors import Busy
from trainyard_core.rpc import admission
from trainyard_core.rpc.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Admission, AdmissionInterceptor
from trainyard_core.rpc.errors import retry_after_s
from trainyard_core.rpc.server import insecure_channel, start_grpc_server
from trainyard_core.testing.wait import eventually, truthy

AGENT = "trainyard.agent.v1.AgentService"
LAUNCH = f"/{AGENT}/LaunchWorkers"


async def _until(condition: Any) -> None:
    await eventually(lambda: truthy(condition()), what="the gate's counts")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Calls:
    """Behaviors that run until released, counting how many run at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running = 0
        self.most = 0

    async def __call__(self, request: Any, context: Any) -> str:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return f"done {request}"


async def _complete(gate: Admission, clock: Clock, n: int, step_s: float) -> None:
    """`n` calls that complete one after another, `step_s` apart on `clock`: the gate measures its rate."""
    async def quick(request: Any, context: Any) -> None:
        return None

    for _ in range(n):
        clock.t += step_s
        await gate.run(quick, None, None, LAUNCH)


async def _one_running_nine_waiting(gate: Admission) -> tuple[Calls, list[asyncio.Task[Any]]]:
    """Ten calls on a gate of one slot: one runs and nine wait, until the returned `Calls` are released."""
    calls = Calls()
    admitted = [asyncio.create_task(gate.run(calls, i, None, LAUNCH)) for i in range(10)]
    await _until(lambda: gate.running == 1 and gate.waiting == 9)
    return calls, admitted


async def test_calls_beyond_the_limit_wait_for_a_slot_and_no_more_than_the_limit_run_at_once() -> None:
    gate = Admission(limit=2, max_wait_s=2.0)
    calls = Calls()
    tasks = [asyncio.create_task(gate.run(calls, i, None, LAUNCH)) for i in range(5)]
    await _until(lambda: gate.running == 2 and gate.waiting == 3)
    assert calls.running == 2
    calls.release.set()
    assert await asyncio.gather(*tasks) == [f"done {i}" for i in range(5)]
    assert calls.most == 2
    assert (gate.running, gate.waiting) == (0, 0)


async def test_a_caller_whose_wait_would_be_long_is_refused_with_appointments_one_calls_time_apart() -> None:
    clock = Clock()
    gate = Admission(limit=1, max_wait_s=1.0, clock=clock)
    await _complete(gate, clock, 11, 0.1)  # 10 calls a second
    assert gate.rate() == pytest.approx(10.0)
    # One running and nine waiting: the last of them waits 1 s (10 ahead at 10 a second), which is allowed.
    calls, admitted = await _one_running_nine_waiting(gate)
    waits = []
    for _ in range(3):
        with pytest.raises(Busy) as refused:
            await gate.run(calls, "late", None, LAUNCH)
        waits.append(refused.value.retry_after_s)
        assert LAUNCH in refused.value.message
    # The first after the ten ahead have cleared; each later one a call's time (0.1 s) after the one before.
    assert waits == pytest.approx([1.0, 1.1, 1.2])
    assert gate.waiting == 9  # refused callers hold nothing
    calls.release.set()
    await asyncio.gather(*admitted)
    assert gate.refusal() is None


async def test_callers_told_the_longest_appointment_do_not_push_later_appointments_past_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """400 callers refused at 10 calls a second: the first 290 are told 1 s to 29.9 s, the rest 30 s, the longest
    the gate names, so they all come back by 30 s. A caller refused 11 s later is told to come after them (19 s),
    not after the 110 appointments beyond 30 s that were never given (it was told 30 s, the cap, again)."""
    monkeypatch.setattr(admission, "RATE_WINDOW", 16)  # the rate measured over the last 16 completions
    clock = Clock()
    gate = Admission(limit=1, max_wait_s=1.0, clock=clock)
    await _complete(gate, clock, 11, 0.1)
    start = clock.t
    calls, admitted = await _one_running_nine_waiting(gate)
    told = []
    for _ in range(400):
        with pytest.raises(Busy) as refused:
            await gate.run(calls, "late", None, LAUNCH)
        told.append(refused.value.retry_after_s)
    assert told[:3] == pytest.approx([1.0, 1.1, 1.2]) and told[289] == pytest.approx(29.9)
    assert told[290:] == pytest.approx([RETRY_AFTER_MAX_S] * 110)
    calls.release.set()
    await asyncio.gather(*admitted)
    clock.t = start + 9.5
    await _complete(gate, clock, 16, 0.1)           # the rate measured afresh, 11.1 s after the storm began
    calls, admitted = await _one_running_nine_waiting(gate)
    with pytest.raises(Busy) as refused:
        await gate.run(calls, "later", None, LAUNCH)
    assert refused.value.retry_after_s == pytest.approx(start + RETRY_AFTER_MAX_S + 0.1 - clock.t)
    calls.release.set()
    await asyncio.gather(*admitted)


async def test_a_new_gate_without_a_measured_rate_lets_a_few_per_slot_wait_then_refuses() -> None:
    gate = Admission(limit=2, max_wait_s=2.0)
    calls = Calls()
    admitted = [asyncio.create_task(gate.run(calls, i, None, LAUNCH)) for i in range(2 + 8)]
    await _until(lambda: gate.running == 2 and gate.waiting == 8)
    with pytest.raises(Busy) as refused:
        await gate.run(calls, "late", None, LAUNCH)
    assert refused.value.retry_after_s >= RETRY_AFTER_MIN_S
    calls.release.set()
    await asyncio.gather(*admitted)


async def test_a_waiting_caller_that_goes_away_leaves_no_slot_taken() -> None:
    gate = Admission(limit=1, max_wait_s=2.0)
    calls = Calls()
    first = asyncio.create_task(gate.run(calls, 1, None, LAUNCH))
    gone = asyncio.create_task(gate.run(calls, 2, None, LAUNCH))
    await _until(lambda: gate.waiting == 1)
    gone.cancel()
    await _until(lambda: gate.waiting == 0)
    calls.release.set()
    assert await first == "done 1"
    assert await gate.run(calls, 3, None, LAUNCH) == "done 3"
    assert (gate.running, gate.waiting) == (0, 0)


class Launches(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.calls = Calls()

    async def LaunchWorkers(self, request: agent_pb2.LaunchWorkersRequest, context: Any) -> Any:
        await self.calls(request.job_id, context)
        return agent_pb2.LaunchWorkersResponse()


class Entries:
    def __init__(self) -> None:
        self.entries: list[AuditEntry] = []

    async def append(self, entry: AuditEntry) -> bool:
        self.entries.append(entry)
        return True


async def test_a_refused_call_gets_unavailable_with_its_appointment_and_is_not_audited() -> None:
    servicer = Launches()
    sink = Entries()
    came: list[str] = []
    admission = AdmissionInterceptor((LAUNCH,), limit=1, max_wait_s=0.5, on_call=came.append)
    server = await start_grpc_server(
        host="127.0.0.1", port=0, service_names=[AGENT], audit=sink, audit_service="agent", admission=admission,
        register=lambda s: agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, s))
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        gate = admission.gates[LAUNCH]
        # One running, four waiting: a new gate lets four per slot wait before it has measured a rate.
        admitted = [asyncio.ensure_future(stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(job_id=f"j-{i}"),
                                                             timeout=30)) for i in range(5)]
        await _until(lambda: gate.running == 1 and gate.waiting == 4)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(job_id="j-late"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "busy" in (refused.value.details() or "")
        asked = retry_after_s(refused.value)
        assert asked is not None and asked >= RETRY_AFTER_MIN_S
        assert came == [LAUNCH] * 6, "every call, refused or not, is told by its method"
        servicer.calls.release.set()
        await asyncio.gather(*admitted)
        await _until(lambda: len(sink.entries) == 5)
        assert sorted(e.target for e in sink.entries) == [f"job/j-{i}" for i in range(5)]
        assert all(e.result == "ok" for e in sink.entries)
    finally:
        await channel.close()
        await server.server.stop(grace=0)


def test_a_call_refused_for_another_reason_names_no_appointment() -> None:
    exc = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="no leader")
    assert retry_after_s(exc) is None
    odd = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                               grpc.aio.Metadata(("trainyard-retry-after-ms", "soon")), details="busy")
    assert retry_after_s(odd) is None


async def test_every_call_is_told_before_it_is_admitted_or_refused() -> None:
    """A server that cannot serve a storm of calls yet still learns that callers keep coming (a new scheduler
    leader's grace lasts while agents keep calling to register, served or not)."""
    told: list[str] = []
    clock = Clock()
    gate = Admission(limit=1, max_wait_s=1.0, clock=clock, on_call=lambda: told.append("call"))
    await _complete(gate, clock, 11, 0.1)
    assert len(told) == 11
    calls, admitted = await _one_running_nine_waiting(gate)
    with pytest.raises(Busy):
        await gate.run(calls, "late", None, LAUNCH)
    assert len(told) == 22, "the ten admitted and the one refused"
    calls.release.set()
    await asyncio.gather(*admitted)
