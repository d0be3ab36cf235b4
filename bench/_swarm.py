"""What the benchmarks that simulate a fleet share: process figures from /proc, the simulated node (an 8-GPU
H100 host, its inventory read once through the agent's real NVML adapter over the fake NVML), node ids and
their certificates, and the parent's handle on a swarm process (`Swarm`).

A swarm process (`_simagent.serve`) runs many simulated agents on one event loop. Each speaks the real agent
protocol: `trainyard_agent.report.Reporter` and `ExitReporter` over its own mTLS channels to the scheduler,
presenting its own node certificate, and the agents' gRPC bootstrap (`start_grpc_server`: mTLS, the
authorization table) serving AgentService for the scheduler's launches and stops. It launches nothing (see
`_simagent.SimWorkers`).

The parent talks to a swarm process over a pipe, one request and one answer at a time:

    ("start", ids, per_s, wait_s)  start these nodes, `per_s` a second; answer once each has registered, or
                           `wait_s` after the last start with those that have not
    ("silence", ids)       blackhole these nodes (they were started behind a proxy); answer the times
    ("stats",)             counts (registrations, launches, exits reported) and the process's CPU
    ("stop",)              stop every node cleanly, then exit

A crash is not a request: the parent SIGKILLs the process (`Swarm.kill`), so the kernel closes its sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from trainyard_agent.model import Accelerator, Inventory, NodeInfo
from trainyard_core.security import identity, pki

CLK_TCK = os.sysconf("SC_CLK_TCK")
GPUS_PER_NODE = 8
GPU_PROFILE = "h100x8"
# Certificates and etcd's data go here when it exists: issuing thousands of certificates costs an fsync each.
FAST_TMP = Path("/dev/shm")


def _cpu_clock(pid: int) -> int:
    """Linux's CPU-time clock of a whole process (every thread, exited ones included), what
    clock_getcpuclockid(3) returns: CPUCLOCK_SCHED of the pid, to nanoseconds."""
    return ((~pid) << 3) | 2


def cpu_s(pid: int) -> float:
    """CPU time (user + system) a process has used, in seconds. From its CPU-time clock, exact to the
    nanosecond: utime + stime in /proc/<pid>/stat count whole clock ticks (10 ms here), which over a window of
    a few seconds and a hundred nodes is 20 µs per node-second, the size of what the benchmarks compare. The
    ticks are the fallback where the clock cannot be read."""
    try:
        return time.clock_gettime(_cpu_clock(pid))
    except OSError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sockets(pid: int) -> int:
    """How many sockets the process holds open (its connections, listeners and datagram sockets)."""
    fd_dir = f"/proc/{pid}/fd"
    count = 0
    for name in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{name}").startswith("socket:"):
                count += 1
        except OSError:  # closed meanwhile
            continue
    return count


def host_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])
    return total - idle, total


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tmpdir(prefix: str) -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix=prefix, dir=FAST_TMP if FAST_TMP.is_dir() else None)


def node_ids(count: int, prefix: str = "fleet") -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(count)]


def issue_certs(pki_dir: Path, ids: Iterable[str]) -> None:
    """A node certificate (trainyard://node/<id>) for each id, from the cluster's CA (`pki.ensure`)."""
    pki.ensure(pki_dir, [identity.node(n) for n in ids])


@cache
def _inventory() -> Inventory:
    # The agent's own adapter over the fake NVML, once per process: the same GPUs, links and driver a simulated
    # agent registers; only the UUIDs differ per node (`accelerators`).
    from trainyard_agent.nvml.adapter import NvmlAdapter
    from trainyard_agent.nvml.fake import FakeNvml

    fake = FakeNvml(GPU_PROFILE, seed="swarm")
    adapter = NvmlAdapter(fake, fake.vendor)
    adapter.open()
    try:
        return adapter.inventory()
    finally:
        adapter.close()


def accelerators(node_id: str) -> tuple[Accelerator, ...]:
    return tuple(dataclasses.replace(g, uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node_id}/{g.index}')}")
                 for g in _inventory().accelerators)


def topology_labels(index: int) -> dict[str, str]:
    """32 nodes under a leaf switch, 8 leaves under a spine."""
    return {"rack": f"rack-{index // 16:04d}", "switch": f"leaf-{index // 32:04d}",
            "spine": f"spine-{index // 256:03d}"}


def node_info(node_id: str, agent_address: str, labels: dict[str, str],
              gpus: Sequence[Accelerator] | None = None) -> NodeInfo:
    inv = _inventory()
    return NodeInfo(node_id=node_id, hostname=node_id, agent_address=agent_address, worker_address="127.0.0.1",
                    accelerators=tuple(gpus if gpus is not None else accelerators(node_id)), cpus=192,
                    memory_mb=2 * 1024 * 1024, driver_version=inv.driver_version, simulated=True, labels=labels,
                    cuda_version=inv.runtime_version, gpu_links=inv.links)


@dataclass(frozen=True)
class SwarmSpec:
    """What a swarm process runs. `nodes`: (node id, topology index) pairs it may be asked to start;
    `behind_proxy`: those that reach the scheduler through a blackhole-able proxy (the ones to go silent)."""

    name: str
    scheduler_address: str
    pki_dir: str
    nodes: tuple[tuple[str, int], ...]
    behind_proxy: frozenset[str] = frozenset()
    log_level: str = "WARNING"
    log_path: str = ""  # "": the parent's stderr


class SwarmError(RuntimeError):
    """A swarm process died or did not answer."""


class Swarm:
    """The parent's handle on one swarm process (a spawned child: nothing of the parent's state, no shared
    sockets)."""

    def __init__(self, spec: SwarmSpec) -> None:
        from . import _simagent

        self.spec = spec
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_simagent.serve, args=(child, spec), name=f"swarm-{spec.name}", daemon=True)
        self._proc.start()
        child.close()
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    async def call(self, *request: Any, timeout: float) -> Any:
        """Send one request, wait for its answer (SwarmError when the process dies or `timeout` passes)."""
        async with self._lock:
            self._conn.send(request)
            answer = await asyncio.to_thread(self._recv, timeout)
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise SwarmError(f"swarm {self.spec.name}: {request[0]} failed: {answer[1]}")
        return answer

    def _recv(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
            if not self._proc.is_alive():
                raise SwarmError(f"swarm {self.spec.name} exited with code {self._proc.exitcode}")
            if time.monotonic() >= deadline:
                raise SwarmError(f"swarm {self.spec.name} did not answer within {timeout:g}s")
        try:
            return self._conn.recv()
        except EOFError:
            raise SwarmError(f"swarm {self.spec.name} closed its pipe (exit code {self._proc.exitcode})") from None

    def kill(self) -> float:
        """SIGKILL the process: its nodes crash (the kernel closes their sockets). The monotonic time of the kill
        (CLOCK_MONOTONIC is one clock for every process of the machine)."""
        at = time.monotonic()
        self._proc.kill()
        self._proc.join(10)
        return at

    async def close(self, timeout: float = 30.0) -> None:
        """Stop cleanly if it still runs, else (or when that fails) kill it."""
        if self._proc.is_alive():
            try:
                await self.call("stop", timeout=timeout)
            except (SwarmError, OSError):
                pass
            await asyncio.to_thread(self._proc.join, 5)
        if self._proc.is_alive():
            self.kill()
        self._conn.close()
