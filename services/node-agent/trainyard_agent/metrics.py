"""Prometheus metrics of the agent. Module-level collectors (the registry is per process); every series
carries `node` so several agents in one process (tests) do not overwrite each other.

The driver's error counters are exported as gauges: they are the driver's counts (they restart with a GPU
reset or a reboot), not counters this process owns.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge

from .model import Accelerator, AcceleratorMetrics

GPU_UTILIZATION = Gauge("trainyard_agent_gpu_utilization_percent", "GPU utilization", ["node", "gpu"])
GPU_MEMORY_USED = Gauge("trainyard_agent_gpu_memory_used_bytes", "GPU memory in use", ["node", "gpu"])
GPU_TEMPERATURE = Gauge("trainyard_agent_gpu_temperature_celsius", "GPU temperature", ["node", "gpu"])
GPU_POWER = Gauge("trainyard_agent_gpu_power_watts", "GPU power draw", ["node", "gpu"])
GPU_SM_CLOCK = Gauge("trainyard_agent_gpu_sm_clock_mhz", "GPU SM clock", ["node", "gpu"])
GPU_THROTTLED = Gauge("trainyard_agent_gpu_clock_throttled", "1 while this reason holds the GPU's clocks down",
                      ["node", "gpu", "reason"])
GPU_ECC_UNCORRECTED = Gauge("trainyard_agent_gpu_ecc_uncorrected_volatile",
                            "Uncorrectable ECC errors since the driver loaded", ["node", "gpu"])
GPU_NVLINK_ERRORS = Gauge("trainyard_agent_gpu_nvlink_errors", "NVLink data-link errors (driver's count)",
                          ["node", "gpu"])
GPU_PCIE_REPLAYS = Gauge("trainyard_agent_gpu_pcie_replays", "PCIe replays (driver's count)", ["node", "gpu"])
GPU_HEALTH = Gauge("trainyard_agent_gpu_health", "1 healthy, 2 degraded, 3 unhealthy", ["node", "gpu"])
GPU_XIDS = Counter("trainyard_agent_gpu_xid_total", "XID events seen", ["node", "gpu", "xid"])
WORKERS_RUNNING = Gauge("trainyard_agent_workers_running", "Worker processes running", ["node"])
WORKER_EXITS = Counter("trainyard_agent_worker_exits_total", "Worker processes that ended",
                       ["node", "outcome"])
SCHEDULER_RECONNECTS = Counter("trainyard_agent_scheduler_reconnects_total",
                               "Registrations after a lost scheduler connection", ["node"])

# The reasons that cost performance; the others (idle, application clocks, display) are routine.
_THROTTLE_EXPORTED = ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal", "sw_power_cap")


def publish_gpu_metrics(node: str, metrics: Sequence[AcceleratorMetrics],
                        gpus: Sequence[Accelerator]) -> None:
    for m in metrics:
        gpu = str(m.index)
        GPU_UTILIZATION.labels(node, gpu).set(m.utilization_percent)
        GPU_MEMORY_USED.labels(node, gpu).set(m.memory_used_mb * 1024 * 1024)
        GPU_TEMPERATURE.labels(node, gpu).set(m.temperature_c)
        GPU_POWER.labels(node, gpu).set(m.power_w)
        GPU_SM_CLOCK.labels(node, gpu).set(m.sm_clock_mhz)
        for reason in _THROTTLE_EXPORTED:
            GPU_THROTTLED.labels(node, gpu, reason).set(1 if reason in m.throttle_reasons else 0)
        GPU_ECC_UNCORRECTED.labels(node, gpu).set(m.counters.ecc_volatile_uncorrected)
        GPU_NVLINK_ERRORS.labels(node, gpu).set(m.counters.nvlink_errors)
        GPU_PCIE_REPLAYS.labels(node, gpu).set(m.counters.pcie_replays)
    for g in gpus:
        GPU_HEALTH.labels(node, str(g.index)).set(int(g.health))


def count_xid(node: str, gpu: int, xid: int) -> None:
    GPU_XIDS.labels(node, str(gpu), str(xid)).inc()
