"""What a heartbeat costs the scheduler with mTLS on, against the same with every service on plaintext, same run.

Two local clusters (real etcd, scheduler, gateway; no agents) run side by side, one with mTLS and the
authorization table, one with insecure_plaintext. A swarm in this process speaks the agent's protocol to each:
`nodes` simulated nodes register (the 8-GPU H100 host of `_swarm.py`) and keep one Heartbeat stream open, beating
every `interval_ms` with 8 GPUs' metrics, as agents did before their beats carried only changes (the heavier
beat; the scheduler ignores the metrics now); on the TLS side each node presents its own node
certificate, so the interceptor checks every beat against the node it names. Both swarms beat at once for
`rounds` windows of `window_s`; in each window the scheduler's CPU time (its process's CPU-time clock,
`_swarm.cpu_s`), less what the same scheduler spent idle over as long a window before any node registered
(its reconcile loop and election), is divided by the beats it acknowledged.

Figures: `heartbeat_cpu_us_tls`, `heartbeat_cpu_us_plaintext` (medians over the windows),
`heartbeat_cpu_tls_vs_plaintext` (the ratio of the two; target <= 1.2), `scheduler_idle_cpu_percent_tls` /
`_plaintext` (the idle baseline, % of a core), `beat_ack_p50_ms_tls` /
`_plaintext` (beat sent → its ack seen by the swarm) and their ratio. The fleet benchmark (`fleet.py`) measures
the scheduler holding thousands of agents; this one isolates what transport security adds to each beat.

Then the same nodes hold the agent's current protocol: one stream each whose first beat asks for a pulse
session, the agent's own `Pulser` sending a pulse every 0.5 s (what keeps an idle node alive now), and the
refresh beat an agent sends when nothing changed, every `refresh_ms` (the scheduler's default heartbeat
interval, 10 s). Every simulated node's channel is the agent's own (`trainyard_agent.app.scheduler_channel`,
with its keepalive options), as in the beat phase. Over as many windows, the scheduler's CPU per node-second (idle
baseline subtracted; 1 µs is the resolution, the floor of each window's figure):
`liveness_cpu_us_per_node_s_tls`, `_plaintext`, and `liveness_cpu_tls_vs_plaintext`, what transport security
adds to keeping a node alive (the pulses themselves are the same datagrams in both: authenticated by their
session key, not by TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import scheduler_channel
from trainyard_agent.grpc.convert import node_to_pb
from trainyard_agent.pulse import Pulser
from trainyard_cli.local import LocalCluster
from trainyard_core.clock import SystemClock
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_scheduler.settings import SchedulerSettings

from ._swarm import cpu_s, issue_certs, node_ids, node_info, tmpdir, topology_labels


@dataclass(frozen=True)
class Config:
    nodes: int = 300  # at 100 the idle baseline's noise was as large as the per-node figure
    interval_ms: int = 500
    rounds: int = 8
    window_s: float = 5.0
    # The liveness phase's refresh beat: the scheduler's default heartbeat_interval_ms, what agents send
    # when nothing changed.
    refresh_ms: int = SchedulerSettings.model_fields["heartbeat_interval_ms"].default


TINY = Config(nodes=4, interval_ms=200, rounds=2, window_s=1.0, refresh_ms=500)
PREFIX = "swarm"
LIVENESS_RESOLUTION_US = 1.0


def _metrics() -> list[types_pb2.GpuMetrics]:
    return [types_pb2.GpuMetrics(index=i, utilization_percent=97, memory_used_mb=70_000, temperature_c=61,
                                 power_w=650, sm_clock_mhz=1980, memory_clock_mhz=2619) for i in range(8)]


class SimNode:
    """One simulated agent: registers, then beats on one stream and records beat → ack latency."""

    def __init__(self, node_id: str, index: int, channel: grpc.aio.Channel, interval_s: float) -> None:
        self.node_id = node_id
        # The fleet benchmark's simulated node (no agent serves at its address: nothing is launched here).
        self.node = node_to_pb(node_info(node_id, "127.0.0.1:9", topology_labels(index)))
        self.channel = channel
        self.interval_s = interval_s
        self.acked = 0
        self.latencies_ms: list[float] = []
        self._sent: dict[int, float] = {}
        self.recording = False
        self.pulser: Pulser | None = None
        self.refreshes_acked = 0

    async def run(self, stop: asyncio.Event) -> None:
        stub = scheduler_pb2_grpc.NodeServiceStub(self.channel)
        await stub.RegisterNode(scheduler_pb2.RegisterNodeRequest(node=self.node), timeout=30)
        metrics = _metrics()

        async def beats() -> AsyncIterator[scheduler_pb2.HeartbeatRequest]:
            seq = 0
            while not stop.is_set():
                seq += 1
                now = time.time()
                ts = Timestamp()
                ts.FromNanoseconds(int(now * 1e9))
                self._sent[seq] = time.perf_counter()
                yield scheduler_pb2.HeartbeatRequest(node_id=self.node_id, seq=seq, sent_at=ts, gpu_metrics=metrics)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

        async for ack in stub.Heartbeat(beats()):
            sent = self._sent.pop(ack.ack_seq, None)
            if sent is not None and self.recording:
                self.acked += 1
                self.latencies_ms.append((time.perf_counter() - sent) * 1e3)

    async def hold(self, address: str, stop: asyncio.Event, refresh_s: float) -> None:
        """The current protocol, idle: one beat asking for pulses, then pulses, and the agent's refresh beat every
        `refresh_s` (the first one at a random point of the first interval, as agents that started apart
        spread theirs), until `stop`."""
        stub = scheduler_pb2_grpc.NodeServiceStub(self.channel)

        async def beats() -> AsyncIterator[scheduler_pb2.HeartbeatRequest]:
            yield scheduler_pb2.HeartbeatRequest(node_id=self.node_id, seq=1, pulses=True)
            seq, wait = 1, random.uniform(0, refresh_s)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
                if stop.is_set():
                    break
                seq, wait = seq + 1, refresh_s
                ts = Timestamp()
                ts.FromNanoseconds(time.time_ns())
                yield scheduler_pb2.HeartbeatRequest(node_id=self.node_id, seq=seq, sent_at=ts)

        call = stub.Heartbeat(beats())
        first = await call.read()
        assert isinstance(first, scheduler_pb2.HeartbeatResponse) and first.pulse_session, first
        pulser = Pulser.for_session(address, first, SystemClock())
        await pulser.start()
        self.pulser = pulser

        async def answers() -> None:  # read(), not iteration: gRPC refuses to mix the two on one call
            while isinstance(answer := await call.read(), scheduler_pb2.HeartbeatResponse):
                if answer.ack_seq > 1:
                    self.refreshes_acked += 1

        reader = asyncio.create_task(answers())
        try:
            await stop.wait()
        finally:
            await pulser.stop()
            call.cancel()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def _swarm(cluster: LocalCluster, count: int, interval_s: float, tls: bool) -> list[SimNode]:
    address = cluster.scheduler_addresses[0]
    nodes = []
    for i, node_id in enumerate(node_ids(count, PREFIX)):
        # The agent's own channel to the scheduler (its keepalive options among them): a channel with other
        # options measures something agents do not do. The generic channel options ping every 10 s, and each
        # answered ping costs the server a read and a write through TLS, which was most of the difference this
        # benchmark once reported for idle pulsing nodes.
        creds = ClientTls(pki.files_for(cluster.pki_dir, identity.node(node_id))) if tls else None
        channel = scheduler_channel(address, creds)().channel
        nodes.append(SimNode(node_id, i, channel, interval_s))
    return nodes


async def _measure(config: Config, clusters: dict[bool, LocalCluster]) -> dict[str, float]:
    pids = {tls: c.procs["scheduler"].popen.pid for tls, c in clusters.items() if c.procs["scheduler"].popen}
    before = {tls: cpu_s(pid) for tls, pid in pids.items()}
    await asyncio.sleep(config.window_s)
    idle = {tls: (cpu_s(pid) - before[tls]) / config.window_s for tls, pid in pids.items()}  # CPU s per s
    stop = asyncio.Event()
    swarms = {tls: await _swarm(c, config.nodes, config.interval_ms / 1000, tls) for tls, c in clusters.items()}
    tasks = [asyncio.create_task(n.run(stop)) for swarm in swarms.values() for n in swarm]
    per_beat: dict[bool, list[float]] = {True: [], False: []}
    try:
        await asyncio.sleep(max(1.0, 2 * config.interval_ms / 1000))  # registered, streams open, first beats in
        for task in tasks:
            if task.done():
                task.result()  # a node that could not register or beat is a failed benchmark, not a figure
        for _ in range(config.rounds):
            before = {tls: cpu_s(pid) for tls, pid in pids.items()}
            for swarm in swarms.values():
                for n in swarm:
                    n.acked, n.recording = 0, True
            started = time.perf_counter()
            await asyncio.sleep(config.window_s)
            took = time.perf_counter() - started
            for tls, swarm in swarms.items():
                for n in swarm:
                    n.recording = False
                beats = sum(n.acked for n in swarm)
                if beats:
                    busy = cpu_s(pids[tls]) - before[tls] - idle[tls] * took
                    per_beat[tls].append(busy / beats * 1e6)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    tls_us, plain_us = statistics.median(per_beat[True]), statistics.median(per_beat[False])
    ack = {tls: statistics.median([v for n in swarm for v in n.latencies_ms]) for tls, swarm in swarms.items()}
    try:
        live = await _liveness(config, clusters, swarms, pids, idle)
    finally:
        for swarm in swarms.values():
            for n in swarm:
                await n.channel.close()
    return {
        "liveness_cpu_us_per_node_s_tls": live[True],
        "liveness_cpu_us_per_node_s_plaintext": live[False],
        "liveness_cpu_tls_vs_plaintext": live[True] / live[False],
        "heartbeat_cpu_us_tls": tls_us,
        "heartbeat_cpu_us_plaintext": plain_us,
        "heartbeat_cpu_tls_vs_plaintext": tls_us / plain_us,
        "scheduler_idle_cpu_percent_tls": idle[True] * 100,
        "scheduler_idle_cpu_percent_plaintext": idle[False] * 100,
        "beat_ack_p50_ms_tls": ack[True],
        "beat_ack_p50_ms_plaintext": ack[False],
        "beat_ack_p50_tls_vs_plaintext": ack[True] / ack[False],
        "nodes": float(config.nodes),
        "interval_ms": float(config.interval_ms),
        "windows": float(config.rounds),
    }


async def _liveness(config: Config, clusters: dict[bool, LocalCluster], swarms: dict[bool, list[SimNode]],
                    pids: dict[bool, int], idle: dict[bool, float]) -> dict[bool, float]:
    """The scheduler's CPU per node-second (idle subtracted, median of the windows) with every node holding an
    idle stream and pulsing, on each side."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(n.hold(clusters[tls].scheduler_addresses[0], stop, config.refresh_ms / 1000))
             for tls, swarm in swarms.items() for n in swarm]
    per_node_s: dict[bool, list[float]] = {True: [], False: []}
    try:
        await asyncio.sleep(2.0)  # every stream open and its pulser started
        for task in tasks:
            if task.done():
                task.result()
        for _ in range(config.rounds):
            before = {tls: cpu_s(pid) for tls, pid in pids.items()}
            started = time.perf_counter()
            await asyncio.sleep(config.window_s)
            took = time.perf_counter() - started
            for tls, swarm in swarms.items():
                busy = cpu_s(pids[tls]) - before[tls] - idle[tls] * took
                # 1 µs per node-second is the resolution: below it (a tiny run's few nodes) the noise of the
                # idle baseline is all there is, and a ratio over zero would mean nothing.
                per_node_s[tls].append(max(busy / (len(swarm) * took) * 1e6, LIVENESS_RESOLUTION_US))
        acked = [n.pulser.acks for swarm in swarms.values() for n in swarm if n.pulser is not None]
        if len(acked) != sum(len(s) for s in swarms.values()) or min(acked) == 0:
            raise RuntimeError("some simulated nodes never had a pulse acknowledged: the figure would be wrong")
        refreshed = sum(n.refreshes_acked for swarm in swarms.values() for n in swarm)
        expected = sum(len(s) for s in swarms.values()) * (config.rounds * config.window_s) / (config.refresh_ms / 1000)
        if refreshed < 0.5 * expected:
            raise RuntimeError(f"only {refreshed} refresh beats were acknowledged (about {expected:.0f} were due): "
                               "the figure would leave out the beats agents send")
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {tls: statistics.median(v) for tls, v in per_node_s.items()}


def run(config: Config = Config()) -> dict[str, float]:
    with tmpdir("bench-heartbeat-") as tmp:
        clusters = {tls: LocalCluster(Path(tmp) / ("tls" if tls else "plaintext"), gateway_port=0, nodes=[],
                                      tls=tls, node_timeout_s=max(2.5, 5 * config.interval_ms / 1000),
                                      heartbeat_interval_ms=config.interval_ms)
                    for tls in (True, False)}
        try:
            for c in clusters.values():
                c.start()
            issue_certs(clusters[True].pki_dir, node_ids(config.nodes, PREFIX))
            return asyncio.run(_measure(config, clusters))
        finally:
            for c in clusters.values():
                c.stop()
