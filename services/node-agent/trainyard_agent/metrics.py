"""Prometheus metrics of the agent (served by `trainyard_core.telemetry` on `metrics_port`).

GPU series carry dcgm-exporter's names and labels, so a Grafana dashboard built for dcgm-exporter works on a
Trainyard node unchanged: `DCGM_FI_DEV_GPU_UTIL`, `DCGM_FI_DEV_FB_USED`, ... labelled `gpu` (the index),
`UUID`, `pci_bus_id`, `device` (`nvidia<index>`), `modelName` (the driver's name, "NVIDIA H100 80GB HBM3") and
`Hostname`; and Trainyard's own `node` (the node id), `job` and `team` (the allocation whose running worker
holds the GPU, both empty while none does). What dcgm has no field for (health, throttle reasons, XIDs by
code, retired pages) is `trainyard_agent_gpu_*` with the same labels. services/node-agent/README.md lists
every series.

How the values get here: the GPU monitor publishes each poll (`publish_gpu_metrics`) and each XID
(`count_xid`), the worker supervisor publishes which allocation holds which GPU whenever that changes
(`set_gpu_holders`). `GpuCollector` keeps the latest of each per node and renders them at scrape time, so a
GPU's series always carry its current holder: when a job ends its series move back to empty `job`/`team`
and nothing stale is left behind (a labelled Gauge would keep the old label set until removed by hand).
Several agents in one process (tests) each publish under their own node id.

Every DCGM series is a gauge, also where dcgm-exporter declares a counter (ECC, NVLink, PCIe replays): those
are the driver's counts, which restart with a GPU reset or a reboot, not counts this process owns; and a
counter must be named `*_total` in the OpenMetrics format Prometheus asks for, which dcgm's names are not.
`rate()` works on them all the same.

Host series (network, InfiniBand, CPU, memory) are `host_metrics.HostCollector`'s, one per process.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .host_metrics import HostCollector
from .model import Accelerator, AcceleratorMetrics, Vendor

WORKERS_RUNNING = Gauge("trainyard_agent_workers_running", "Worker processes running", ["node"])
WORKER_EXITS = Counter("trainyard_agent_worker_exits_total", "Worker processes that ended",
                       ["node", "outcome"])
SCHEDULER_RECONNECTS = Counter("trainyard_agent_scheduler_reconnects_total",
                               "Registrations after a lost scheduler connection", ["node"])

# dcgm-exporter's labels, in its order, then Trainyard's.
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "node", "job", "team")
# The reasons that cost performance; the others (idle, application clocks, display) are routine.
THROTTLE_EXPORTED = ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal", "sw_power_cap")


@dataclass(frozen=True)
class GpuHolder:
    """The allocation whose running worker holds a GPU, as the `job` and `team` labels show it."""

    job_id: str
    team: str


@dataclass(frozen=True)
class _Field:
    name: str
    help: str
    value: Callable[[AcceleratorMetrics, Accelerator], float]


# One series per sampled GPU (a GPU that stopped answering has none: no value is better than an old one).
DCGM_FIELDS = (
    _Field("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (%)", lambda m, g: m.utilization_percent),
    _Field("DCGM_FI_DEV_FB_USED", "GPU framebuffer memory in use (MiB)", lambda m, g: m.memory_used_mb),
    _Field("DCGM_FI_DEV_FB_FREE", "GPU framebuffer memory free (MiB)",
           lambda m, g: max(0, g.memory_mb - m.memory_used_mb)),
    _Field("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (degrees C)", lambda m, g: m.temperature_c),
    _Field("DCGM_FI_DEV_POWER_USAGE", "GPU power draw (W)", lambda m, g: m.power_w),
    _Field("DCGM_FI_DEV_SM_CLOCK", "SM clock (MHz)", lambda m, g: m.sm_clock_mhz),
    _Field("DCGM_FI_DEV_MEM_CLOCK", "Memory clock (MHz)", lambda m, g: m.memory_clock_mhz),
    # NVML's corrected/uncorrected ECC errors are DCGM's single-/double-bit ones.
    _Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Corrected ECC errors since the driver loaded (driver's count)",
           lambda m, g: m.counters.ecc_volatile_corrected),
    _Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Uncorrectable ECC errors since the driver loaded (driver's count)",
           lambda m, g: m.counters.ecc_volatile_uncorrected),
    _Field("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Uncorrectable ECC errors over the GPU's life (driver's count)",
           lambda m, g: m.counters.ecc_aggregate_uncorrected),
    _Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "PCIe replays (driver's count)", lambda m, g: m.counters.pcie_replays),
    _Field("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "NVLink replays over all links (driver's count)",
           lambda m, g: m.counters.nvlink_replay_errors),
    _Field("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "NVLink recoveries over all links (driver's count)",
           lambda m, g: m.counters.nvlink_recovery_errors),
    _Field("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
           "NVLink flow-control CRC errors over all links (driver's count)",
           lambda m, g: m.counters.nvlink_crc_flit_errors),
    _Field("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "NVLink data CRC errors over all links (driver's count)",
           lambda m, g: m.counters.nvlink_crc_data_errors),
    _Field("DCGM_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_TOTAL", "NVLink data ECC errors over all links (driver's count)",
           lambda m, g: m.counters.nvlink_ecc_data_errors),
    _Field("DCGM_FI_DEV_ROW_REMAP_PENDING", "1 while a row remap waits for a GPU reset",
           lambda m, g: int(m.counters.remapped_rows_pending)),
    _Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "1 once a row remap has failed (the GPU needs replacing)",
           lambda m, g: int(m.counters.remapped_rows_failure)),
    _Field("DCGM_FI_DEV_RETIRED_PENDING", "1 while a page retirement waits for a GPU reset (GPUs before Ampere)",
           lambda m, g: int(m.counters.retired_pages_pending)),
)
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
GPU_HEALTH = "trainyard_agent_gpu_health"
GPU_THROTTLED = "trainyard_agent_gpu_clock_throttled"
GPU_RETIRED_PAGES = "trainyard_agent_gpu_retired_pages"
GPU_XIDS = "trainyard_agent_gpu_xid"  # exposed as trainyard_agent_gpu_xid_total


@dataclass(frozen=True)
class _NodeGpus:
    """What one agent last published. Replaced whole under the collector's lock, never changed in place."""

    hostname: str = ""
    gpus: tuple[Accelerator, ...] = ()
    metrics: tuple[AcceleratorMetrics, ...] = ()
    holders: Mapping[int, GpuHolder] = field(default_factory=dict)
    last_xid: Mapping[int, int] = field(default_factory=dict)
    xid_counts: Mapping[tuple[int, int], int] = field(default_factory=dict)


def device_name(gpu: Accelerator) -> str:
    """dcgm-exporter's `device` label: `nvidia<n>` (the /dev node; the index stands for the minor number,
    which NVML numbers alike on every host we know). Another vendor's GPU is `<vendor><n>`."""
    return f"{'nvidia' if gpu.vendor is Vendor.NVIDIA else gpu.vendor.value}{gpu.index}"


class GpuCollector(Collector):
    """Renders the GPU series from what the agents published. Publishing happens on the event loop, scrapes
    in the HTTP server's thread: the lock guards the per-node snapshots, rendering works on a copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, _NodeGpus] = {}

    def publish(self, node: str, hostname: str, metrics: Sequence[AcceleratorMetrics],
                gpus: Sequence[Accelerator]) -> None:
        with self._lock:
            self._nodes[node] = replace(self._nodes.get(node, _NodeGpus()), hostname=hostname, gpus=tuple(gpus),
                                        metrics=tuple(metrics))

    def record_xid(self, node: str, gpu: int, xid: int) -> None:
        with self._lock:
            state = self._nodes.get(node, _NodeGpus())
            counts = dict(state.xid_counts)
            counts[(gpu, xid)] = counts.get((gpu, xid), 0) + 1
            self._nodes[node] = replace(state, last_xid={**state.last_xid, gpu: xid}, xid_counts=counts)

    def set_holders(self, node: str, holders: Mapping[int, GpuHolder]) -> None:
        with self._lock:
            self._nodes[node] = replace(self._nodes.get(node, _NodeGpus()), holders=dict(holders))

    def forget(self, node: str) -> None:
        """Drop a stopped agent's series (an agent that stops while its process lives on: tests)."""
        with self._lock:
            self._nodes.pop(node, None)

    def describe(self) -> Iterable[Metric]:
        return self._render({})

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            nodes = dict(self._nodes)
        return self._render(nodes)

    def _render(self, nodes: Mapping[str, _NodeGpus]) -> list[Metric]:
        labels = list(GPU_LABELS)
        fields = [(f, GaugeMetricFamily(f.name, f.help, labels=labels)) for f in DCGM_FIELDS]
        xid = GaugeMetricFamily(XID_ERRORS, "The last XID the GPU reported since the agent started; 0 for none",
                                labels=labels)
        health = GaugeMetricFamily(GPU_HEALTH, "GPU health: 1 healthy, 2 degraded, 3 unhealthy", labels=labels)
        throttled = GaugeMetricFamily(GPU_THROTTLED, "1 while this reason holds the GPU's clocks down",
                                      labels=[*labels, "reason"])
        retired = GaugeMetricFamily(GPU_RETIRED_PAGES, "Memory pages retired, for either cause (GPUs before Ampere)",
                                    labels=labels)
        # A count this process owns: by GPU and XID, without job and team (a counter keeps its series).
        xids = CounterMetricFamily(GPU_XIDS, "XID events seen since the agent started",
                                   labels=[*labels[:-2], "xid"])
        for node, state in sorted(nodes.items()):
            by_index = {g.index: g for g in state.gpus}
            ids = {g.index: _identity(g, state.hostname, node, state.holders.get(g.index)) for g in state.gpus}
            for g in state.gpus:
                xid.add_metric(ids[g.index], state.last_xid.get(g.index, 0))
                health.add_metric(ids[g.index], int(g.health))
            for m in state.metrics:
                gpu = by_index.get(m.index)
                if gpu is None:
                    continue
                for f, family in fields:
                    family.add_metric(ids[m.index], f.value(m, gpu))
                for reason in THROTTLE_EXPORTED:
                    throttled.add_metric([*ids[m.index], reason], 1 if reason in m.throttle_reasons else 0)
                retired.add_metric(ids[m.index], m.counters.retired_pages)
            for (index, code), count in sorted(state.xid_counts.items()):
                if index in ids:
                    xids.add_metric([*ids[index][:-2], str(code)], count)
        return [*(family for _, family in fields), xid, health, throttled, retired, xids]


def _identity(gpu: Accelerator, hostname: str, node: str, holder: GpuHolder | None) -> list[str]:
    return [str(gpu.index), gpu.uuid, gpu.pci_bus_id, device_name(gpu), gpu.name, hostname, node,
            holder.job_id if holder else "", holder.team if holder else ""]


def metrics_hostname(node_id: str, *, simulated: bool) -> str:
    """The `Hostname` label: the host's name, as dcgm-exporter writes it; a simulated node's id, since
    several simulated nodes share one host and a dashboard must tell them apart."""
    return node_id if simulated else socket.gethostname()


GPUS = GpuCollector()
REGISTRY.register(GPUS)
# One per process: agents in one process (tests) share the host.
HOST = HostCollector()
REGISTRY.register(HOST)


def publish_gpu_metrics(node: str, hostname: str, metrics: Sequence[AcceleratorMetrics],
                        gpus: Sequence[Accelerator]) -> None:
    GPUS.publish(node, hostname, metrics, gpus)


def count_xid(node: str, gpu: int, xid: int) -> None:
    GPUS.record_xid(node, gpu, xid)


def set_gpu_holders(node: str, holders: Mapping[int, GpuHolder]) -> None:
    GPUS.set_holders(node, holders)


def forget_node(node: str) -> None:
    GPUS.forget(node)
