"""Prometheus metrics of the agent. Module-level collectors (the registry is per process); every series
carries `node` so several agents in one process (tests) do not overwrite each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge

from .model import Accelerator, AcceleratorMetrics

GPU_UTILIZATION = Gauge("trainyard_agent_gpu_utilization_percent", "GPU utilization", ["node", "gpu"])
GPU_MEMORY_USED = Gauge("trainyard_agent_gpu_memory_used_bytes", "GPU memory in use", ["node", "gpu"])
GPU_TEMPERATURE = Gauge("trainyard_agent_gpu_temperature_celsius", "GPU temperature", ["node", "gpu"])
GPU_POWER = Gauge("trainyard_agent_gpu_power_watts", "GPU power draw", ["node", "gpu"])
GPU_HEALTH = Gauge("trainyard_agent_gpu_health", "1 healthy, 2 degraded, 3 unhealthy", ["node", "gpu"])
WORKERS_RUNNING = Gauge("trainyard_agent_workers_running", "Worker processes running", ["node"])
WORKER_EXITS = Counter("trainyard_agent_worker_exits_total", "Worker processes that ended",
                       ["node", "outcome"])
SCHEDULER_RECONNECTS = Counter("trainyard_agent_scheduler_reconnects_total",
                               "Registrations after a lost scheduler connection", ["node"])


def publish_gpu_metrics(node: str, metrics: Sequence[AcceleratorMetrics],
                        gpus: Sequence[Accelerator]) -> None:
    for m in metrics:
        gpu = str(m.index)
        GPU_UTILIZATION.labels(node, gpu).set(m.utilization_percent)
        GPU_MEMORY_USED.labels(node, gpu).set(m.memory_used_mb * 1024 * 1024)
        GPU_TEMPERATURE.labels(node, gpu).set(m.temperature_c)
        GPU_POWER.labels(node, gpu).set(m.power_w)
    for g in gpus:
        GPU_HEALTH.labels(node, str(g.index)).set(int(g.health))
