"""The host's own series on the agent's /metrics: network and InfiniBand traffic, CPU time, memory.

Read from /proc and /sys at each scrape (nothing is sampled in between; Prometheus' `rate()` turns the
counters into bytes/s). All under `trainyard_agent_host_*`, so they never mix with a node_exporter's series
on the same host:

- `trainyard_agent_host_network_{receive,transmit}_{bytes,packets}_total{device}`: /proc/net/dev, per NIC.
  Cardinality is bounded: the loopback interface is left out (traffic between local processes), then at
  most `MAX_INTERFACES` interfaces are kept, physical ones first (those /sys/class/net shows backed by a
  device), then virtual ones (bonds, bridges, VLANs, tunnels), then `veth*` (one per container, created and
  removed all day), each group in name order. `trainyard_agent_host_network_interfaces_omitted` says how many
  the cap left out.
- `trainyard_agent_host_infiniband_{receive,transmit}_{bytes,packets}_total{device,port}`: the port counters
  of /sys/class/infiniband/<device>/ports/<port>/counters, where that directory exists (at most
  `MAX_IB_PORTS` ports). `port_rcv_data`/`port_xmit_data` count 4-byte words; the series are in bytes.
- `trainyard_agent_host_cpu_seconds_total{mode}`: the "cpu" line of /proc/stat (all CPUs together, so one
  series per mode whatever the core count), and `trainyard_agent_host_cpus`, the CPUs it sums over.
- `trainyard_agent_host_memory_{total,available}_bytes`: MemTotal and MemAvailable of /proc/meminfo.
- `trainyard_agent_host_read_errors_total{source}`: reads that failed (source net, infiniband, cpu, memory).
  A file that cannot be read or parsed costs its own series only, never the scrape; the first failure of a
  source is logged, and again after it has recovered.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

MAX_INTERFACES = 32
MAX_IB_PORTS = 32
# port_rcv_data and port_xmit_data count in units of 4 bytes (the InfiniBand spec's PortCounters).
IB_WORD_BYTES = 4
# /proc/stat's columns after "cpu", in order; guest time is already counted in user and nice.
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
SOURCES = ("net", "infiniband", "cpu", "memory")
_PREFIX = "trainyard_agent_host_"


@dataclass(frozen=True)
class NicCounters:
    name: str
    receive_bytes: int
    receive_packets: int
    transmit_bytes: int
    transmit_packets: int


@dataclass(frozen=True)
class IbPort:
    device: str
    port: str
    receive_bytes: int
    transmit_bytes: int
    receive_packets: int | None
    transmit_packets: int | None


def parse_net_dev(text: str) -> list[NicCounters]:
    """/proc/net/dev: two header lines, then `name: 8 receive columns 8 transmit columns` per interface.
    Raises ValueError naming the line that does not read so."""
    out = []
    for line in text.splitlines()[2:]:
        if not line.strip():
            continue
        name, sep, rest = line.partition(":")
        cols = rest.split()
        if not sep or not name.strip() or len(cols) < 16 or not all(c.isdigit() for c in cols[:16]):
            raise ValueError(f"/proc/net/dev line {line.strip()!r} is not `interface: 16 counters`")
        out.append(NicCounters(name.strip(), int(cols[0]), int(cols[1]), int(cols[8]), int(cols[9])))
    return out


def parse_cpu_seconds(text: str, ticks_per_s: int) -> tuple[dict[str, float], int]:
    """/proc/stat: seconds per mode over all CPUs (its first "cpu" line, in clock ticks), and how many CPUs
    ("cpuN" lines) it sums over. Kernels before 2.6.11 have fewer columns: the modes they lack are left out."""
    total: dict[str, float] | None = None
    cpus = 0
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "cpu":
            cols = rest.split()
            if len(cols) < 4 or not all(c.isdigit() for c in cols):
                raise ValueError(f"/proc/stat line {line.strip()!r} is not `cpu` and its tick counts")
            total = {mode: int(v) / ticks_per_s for mode, v in zip(CPU_MODES, cols, strict=False)}
        elif word.startswith("cpu") and word[3:].isdigit():
            cpus += 1
    if total is None:
        raise ValueError("/proc/stat has no `cpu` line")
    return total, cpus


def parse_meminfo(text: str) -> tuple[int, int]:
    """/proc/meminfo: MemTotal and MemAvailable, in bytes (the file says kB and means KiB)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            parts = rest.split()
            if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
                raise ValueError(f"/proc/meminfo line {line.strip()!r} is not `{key}: <n> kB`")
            values[key] = int(parts[0]) * 1024
    missing = [k for k in ("MemTotal", "MemAvailable") if k not in values]
    if missing:
        raise ValueError(f"/proc/meminfo has no {' or '.join(missing)} (MemAvailable needs Linux 3.14 or later)")
    return values["MemTotal"], values["MemAvailable"]


def choose_interfaces(nics: list[NicCounters], class_net: Path, cap: int) -> tuple[list[NicCounters], int]:
    """The interfaces to export and how many the cap left out (the loopback interface is never exported nor
    counted). Physical first, then virtual, then veth (see the module docstring)."""
    def rank(nic: NicCounters) -> tuple[int, str]:
        if nic.name.startswith("veth"):
            return (2, nic.name)
        try:
            virtual = "/devices/virtual/" in os.path.realpath(class_net / nic.name)
        except OSError:
            virtual = False
        return (1 if virtual else 0, nic.name)

    candidates = sorted((n for n in nics if n.name != "lo"), key=rank)
    return candidates[:cap], max(0, len(candidates) - cap)


def read_ib_ports(class_ib: Path, cap: int) -> tuple[list[IbPort], list[str]]:
    """Every port under /sys/class/infiniband (up to `cap`), and the problems of those that could not be read.
    No such directory: no ports, no problem."""
    ports: list[IbPort] = []
    problems: list[str] = []
    if not class_ib.is_dir():
        return ports, problems
    for port_dir in sorted(class_ib.glob("*/ports/*")):
        if len(ports) >= cap:
            break
        counters = port_dir / "counters"
        try:
            ports.append(IbPort(
                device=port_dir.parent.parent.name, port=port_dir.name,
                receive_bytes=_read_count(counters / "port_rcv_data") * IB_WORD_BYTES,
                transmit_bytes=_read_count(counters / "port_xmit_data") * IB_WORD_BYTES,
                receive_packets=_read_optional_count(counters / "port_rcv_packets"),
                transmit_packets=_read_optional_count(counters / "port_xmit_packets")))
        except (OSError, ValueError) as exc:
            problems.append(f"{port_dir}: {exc}")
    return ports, problems


def _read_count(path: Path) -> int:
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path} holds {text[:40]!r}, not a count")
    return int(text)


def _read_optional_count(path: Path) -> int | None:
    try:
        return _read_count(path)
    except FileNotFoundError:
        return None


class HostCollector(Collector):
    """The host series, read at each scrape. `proc_root` and `sys_root` stand for /proc and /sys (tests give
    a directory of their own); `ticks_per_s` is the kernel's USER_HZ (sysconf's SC_CLK_TCK by default)."""

    def __init__(self, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"), *,
                 max_interfaces: int = MAX_INTERFACES, max_ib_ports: int = MAX_IB_PORTS,
                 ticks_per_s: int | None = None) -> None:
        if max_interfaces < 0 or max_ib_ports < 0:
            raise ValueError("max_interfaces and max_ib_ports must be 0 or more")
        self._proc = proc_root
        self._sys = sys_root
        self._max_interfaces = max_interfaces
        self._max_ib_ports = max_ib_ports
        self._ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
        self._lock = threading.Lock()
        self._errors = dict.fromkeys(SOURCES, 0)
        self._failing: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        return list(_Families().all())

    def collect(self) -> Iterable[Metric]:
        # Scrapes may overlap (two Prometheus servers): the error counts and the log-once state are shared.
        with self._lock:
            families = _Families()
            self._net(families)
            self._infiniband(families)
            self._cpu(families)
            self._memory(families)
            for source in SOURCES:
                families.read_errors.add_metric([source], self._errors[source])
            return list(families.all())

    def _net(self, f: _Families) -> None:
        try:
            nics = parse_net_dev((self._proc / "net" / "dev").read_text())
        except (OSError, ValueError) as exc:
            self._failed("net", str(exc))
            return
        self._recovered("net")
        kept, omitted = choose_interfaces(nics, self._sys / "class" / "net", self._max_interfaces)
        for nic in kept:
            f.net_rx_bytes.add_metric([nic.name], nic.receive_bytes)
            f.net_tx_bytes.add_metric([nic.name], nic.transmit_bytes)
            f.net_rx_packets.add_metric([nic.name], nic.receive_packets)
            f.net_tx_packets.add_metric([nic.name], nic.transmit_packets)
        f.net_omitted.add_metric([], omitted)

    def _infiniband(self, f: _Families) -> None:
        ports, problems = read_ib_ports(self._sys / "class" / "infiniband", self._max_ib_ports)
        if problems:
            self._failed("infiniband", "; ".join(problems), count=len(problems))
        else:
            self._recovered("infiniband")
        for p in ports:
            ids = [p.device, p.port]
            f.ib_rx_bytes.add_metric(ids, p.receive_bytes)
            f.ib_tx_bytes.add_metric(ids, p.transmit_bytes)
            if p.receive_packets is not None:
                f.ib_rx_packets.add_metric(ids, p.receive_packets)
            if p.transmit_packets is not None:
                f.ib_tx_packets.add_metric(ids, p.transmit_packets)

    def _cpu(self, f: _Families) -> None:
        try:
            seconds, cpus = parse_cpu_seconds((self._proc / "stat").read_text(), self._ticks_per_s)
        except (OSError, ValueError) as exc:
            self._failed("cpu", str(exc))
            return
        self._recovered("cpu")
        for mode, value in seconds.items():
            f.cpu_seconds.add_metric([mode], value)
        f.cpus.add_metric([], cpus)

    def _memory(self, f: _Families) -> None:
        try:
            total, available = parse_meminfo((self._proc / "meminfo").read_text())
        except (OSError, ValueError) as exc:
            self._failed("memory", str(exc))
            return
        self._recovered("memory")
        f.memory_total.add_metric([], total)
        f.memory_available.add_metric([], available)

    def _failed(self, source: str, problem: str, *, count: int = 1) -> None:
        self._errors[source] += count
        if source not in self._failing:
            self._failing.add(source)
            log.warning("cannot read the host's %s counters; their series are left out until they can be read: %s",
                        source, problem, extra={"source": source})

    def _recovered(self, source: str) -> None:
        if source in self._failing:
            self._failing.discard(source)
            log.info("the host's %s counters can be read again", source, extra={"source": source})


class _Families:
    """The families of one scrape, empty until filled."""

    def __init__(self) -> None:
        p = _PREFIX
        self.net_rx_bytes = CounterMetricFamily(f"{p}network_receive_bytes", "Bytes received by the interface",
                                                labels=["device"])
        self.net_tx_bytes = CounterMetricFamily(f"{p}network_transmit_bytes", "Bytes sent by the interface",
                                                labels=["device"])
        self.net_rx_packets = CounterMetricFamily(f"{p}network_receive_packets", "Packets received by the interface",
                                                  labels=["device"])
        self.net_tx_packets = CounterMetricFamily(f"{p}network_transmit_packets", "Packets sent by the interface",
                                                  labels=["device"])
        self.net_omitted = GaugeMetricFamily(f"{p}network_interfaces_omitted",
                                             "Interfaces left out by the cap on exported interfaces")
        self.ib_rx_bytes = CounterMetricFamily(f"{p}infiniband_receive_bytes", "Bytes received by the InfiniBand port",
                                               labels=["device", "port"])
        self.ib_tx_bytes = CounterMetricFamily(f"{p}infiniband_transmit_bytes", "Bytes sent by the InfiniBand port",
                                               labels=["device", "port"])
        self.ib_rx_packets = CounterMetricFamily(f"{p}infiniband_receive_packets",
                                                 "Packets received by the InfiniBand port", labels=["device", "port"])
        self.ib_tx_packets = CounterMetricFamily(f"{p}infiniband_transmit_packets",
                                                 "Packets sent by the InfiniBand port", labels=["device", "port"])
        self.cpu_seconds = CounterMetricFamily(f"{p}cpu_seconds", "CPU time of all CPUs together, by mode",
                                               labels=["mode"])
        self.cpus = GaugeMetricFamily(f"{p}cpus", "CPUs online (what cpu_seconds sums over)")
        self.memory_total = GaugeMetricFamily(f"{p}memory_total_bytes", "Physical memory (MemTotal)")
        self.memory_available = GaugeMetricFamily(f"{p}memory_available_bytes",
                                                  "Memory available to new work without swapping (MemAvailable)")
        self.read_errors = CounterMetricFamily(f"{p}read_errors", "Reads of the host's counters that failed",
                                               labels=["source"])

    def all(self) -> Iterator[Metric]:
        return iter(v for v in vars(self).values() if isinstance(v, Metric))
