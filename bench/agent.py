"""Node agent overhead: a real `trainyard-agent` process with 8 simulated GPUs (h100x8) polled at 1 Hz and its
heartbeat stream open, registered with a real scheduler (and etcd) started here, observed for 60 s.

The agent polls its GPUs at its own `heartbeat_interval_s` (1 s); its stream carries beats only on a change
and a refresh at the interval the scheduler hands it, the scheduler's `heartbeat_interval_ms`: 1,000 here, a
tenth of the 10 s default, so the figure bounds the agent's cost from above (set
BENCH_AGENT_HEARTBEAT_INTERVAL_MS=10000 to measure the default). Keepalive pings on the stream (1 s) are
gRPC's C core. Nothing here is ever lost.

Figures:
- agent_cpu_percent_of_core: the process's CPU time (its CPU-time clock, `_swarm.cpu_s`) over the 60 s window
  (after start-up), as a percentage of one core. Target ≤ 1.
- agent_rss_mb: the largest VmRSS (/proc/<pid>/status) seen, sampled every second through the window and
  the XID phase. Target ≤ 80.
- xid_to_scheduler_ms: p99 over 20 injections (XID 79 on GPU 0..7 in turn, through the InjectFault RPC)
  of the time until the scheduler's NodeService.GetNode shows that GPU unhealthy; the GPU is marked
  healthy again with SetGpuHealth between injections.
Baselines measured in the same run: an idle interpreter (`python -c 'import time; time.sleep(...)'`) over
the same window (CPU and RSS), and the round trip of one GetNode call (the floor of the polling loop).
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_cli.local import Proc
from trainyard_core.security import identity, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.tls import ClientTls, target_name_option
from trainyard_core.testing.etcd import EtcdProcess, find_etcd, free_port
from trainyard_core.testing.wait import until

from ._swarm import cpu_s

NODE = "bench-node"
GPUS = 8
TARGET_CPU_PERCENT = 1.0
TARGET_RSS_MB = 80.0


@dataclass(frozen=True)
class Config:
    window_s: float = 60.0
    warmup_s: float = 5.0         # start-up work (imports, registration) is not the steady state
    injections: int = 20
    rtt_samples: int = 50
    heartbeat_interval_ms: int = 1000

    def scheduler_settings(self) -> dict[str, str]:
        """The settings the scheduler is started with; its own validation accepts them."""
        return {"heartbeat_interval_ms": str(self.heartbeat_interval_ms)}


TINY = Config(window_s=3.0, warmup_s=1.0, injections=2, rtt_samples=5)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _proc(workdir: Path, name: str, module: str, prefix: str, settings: dict[str, str]) -> Proc:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({f"{prefix}{k.upper()}": v for k, v in settings.items()})
    env[f"{prefix}READY_FILE"] = str(workdir / f"{name}.ready")
    env["PYTHONUNBUFFERED"] = "1"
    return Proc(name=name, args=[sys.executable, "-m", module], env=env, log_path=workdir / f"{name}.log",
                ready_path=workdir / f"{name}.ready")


def _gpu_is_healthy(nodes: scheduler_pb2_grpc.NodeServiceStub, index: int) -> bool:
    return _gpu_health(nodes, index) == types_pb2.GPU_HEALTH_HEALTHY


def _gpu_is_unhealthy(nodes: scheduler_pb2_grpc.NodeServiceStub, index: int) -> bool:
    return _gpu_health(nodes, index) == types_pb2.GPU_HEALTH_UNHEALTHY


def _gpu_health(nodes: scheduler_pb2_grpc.NodeServiceStub, index: int) -> int:
    try:
        node = nodes.GetNode(scheduler_pb2.GetNodeRequest(node_id=NODE), timeout=5).node
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):  # not leading / registered yet
            return types_pb2.GPU_HEALTH_UNSPECIFIED
        raise
    return node.gpus[index].health if len(node.gpus) > index else types_pb2.GPU_HEALTH_UNSPECIFIED


def run(config: Config = Config()) -> dict[str, float]:
    find_etcd()
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-agent-") as tmp:
        work = Path(tmp)
        etcd = EtcdProcess(name="bench", host="127.0.0.1", client_port=free_port(), peer_port=free_port(),
                           data_dir=work / "etcd", log_path=work / "etcd.log")
        etcd.start()
        procs: list[Proc] = []
        idle: subprocess.Popen[bytes] | None = None
        try:
            etcd.wait_ready()
            port = free_port()
            # mTLS on, as in production.
            certs = pki.ensure(work / "pki", [identity.SCHEDULER, identity.node(NODE), identity.tool("bench")])

            def tls(p: Principal) -> dict[str, str]:
                return certs[p].settings()
            scheduler = _proc(work, "scheduler", "trainyard_scheduler.main", "TRAINYARD_SCHEDULER_", {
                "etcd_endpoints": etcd.endpoint, "etcd_insecure_plaintext": "true", "listen_port": str(port),
                **config.scheduler_settings(),
                **tls(identity.SCHEDULER)})
            agent = _proc(work, "agent", "trainyard_agent.main", "TRAINYARD_AGENT_", {
                "node_id": NODE, "gpu_profile": "h100x8", "scheduler_address": f"127.0.0.1:{port}",
                "listen_port": "0", "state_dir": str(work / "agent-state"), "heartbeat_interval_s": "1",
                "single_tenant": "true", **tls(identity.node(NODE))})
            procs = [scheduler, agent]
            scheduler.start()
            scheduler.wait_ready()
            agent.start()
            agent_port = agent.wait_ready()["grpc_port"]
            assert agent.popen is not None
            pid = agent.popen.pid
            creds = ClientTls(certs[identity.tool("bench")]).credentials()
            with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=[target_name_option(identity.SCHEDULER)]) \
                    as sched_channel, \
                    grpc.secure_channel(f"127.0.0.1:{agent_port}", creds,
                                        options=[target_name_option(identity.node(NODE))]) as agent_channel:
                nodes = scheduler_pb2_grpc.NodeServiceStub(sched_channel)
                agents = agent_pb2_grpc.AgentServiceStub(agent_channel)
                until(functools.partial(_gpu_is_healthy, nodes, GPUS - 1), 30.0, "the node to register")

                idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                time.sleep(config.warmup_s)
                rss = [_rss_mb(pid)]
                idle_rss = [_rss_mb(idle.pid)]
                cpu0, idle_cpu0, t0 = cpu_s(pid), cpu_s(idle.pid), time.monotonic()
                while time.monotonic() - t0 < config.window_s:
                    time.sleep(1.0)
                    rss.append(_rss_mb(pid))
                    idle_rss.append(_rss_mb(idle.pid))
                elapsed = time.monotonic() - t0
                cpu = (cpu_s(pid) - cpu0) / elapsed * 100
                idle_cpu = (cpu_s(idle.pid) - idle_cpu0) / elapsed * 100

                rtts = []
                for _ in range(config.rtt_samples):
                    t = time.perf_counter()
                    _gpu_health(nodes, 0)
                    rtts.append(time.perf_counter() - t)

                latencies = []
                for i in range(config.injections):
                    gpu = i % GPUS
                    t = time.perf_counter()
                    agents.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=gpu, kind="xid", xid=79), timeout=10)
                    # Each GetNode is a round trip: the loop paces itself (no sleep between probes).
                    until(functools.partial(_gpu_is_unhealthy, nodes, gpu), 30.0, "the XID to reach the scheduler",
                          interval=0.0)
                    latencies.append(time.perf_counter() - t)
                    rss.append(_rss_mb(pid))
                    agents.SetGpuHealth(agent_pb2.SetGpuHealthRequest(
                        gpu_index=gpu, healthy=True, operator="bench", reason="benchmark reset"), timeout=10)
                    until(functools.partial(_gpu_is_healthy, nodes, gpu), 30.0,
                          "the GPU to be healthy again")
        finally:
            if idle is not None:
                idle.kill()
                idle.wait()
            for p in reversed(procs):
                p.stop()
            etcd.kill()

    rss_mb, idle_rss_mb = max(rss), max(idle_rss)
    xid_p99 = _pct(latencies, 0.99) * 1000
    rtt = statistics.median(rtts) * 1000
    return {
        "agent_cpu_percent_of_core": cpu,
        "agent_rss_mb": rss_mb,
        "xid_to_scheduler_ms": xid_p99,
        "xid_to_scheduler_p50_ms": statistics.median(latencies) * 1000,
        "idle_python_cpu_percent_of_core": idle_cpu,
        "idle_python_rss_mb": idle_rss_mb,
        "getnode_rtt_ms": rtt,
        "agent_rss_mb_vs_idle_python_rss_mb": rss_mb / idle_rss_mb,
        "agent_cpu_percent_of_core_vs_target": cpu / TARGET_CPU_PERCENT,
        "agent_rss_mb_vs_target": rss_mb / TARGET_RSS_MB,
        "xid_to_scheduler_ms_vs_getnode_rtt_ms": xid_p99 / rtt,
        "window_s": elapsed,
        "xid_injections": float(len(latencies)),
        "heartbeat_interval_ms": float(config.heartbeat_interval_ms),
    }
