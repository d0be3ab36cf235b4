"""The agent's /metrics: dcgm-exporter's GPU series with Trainyard's job and team labels, and the host's series.

The endpoint tests run `trainyard-agent` as a real process (simulated GPUs: the fake NVML is the only fake) with
`--metrics-port`, as production serves it, against the real scheduler, and change the fake hardware through the
agent's own fault injection. The value-mapping test drives the fake NVML of an in-process agent directly and
renders the registry the endpoint serves. The host series are read from this machine, and from a fake /proc and
/sys root where the machine has nothing to show (InfiniBand, many interfaces, broken files).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc.aio
import pynvml
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.agent.agent_kit import Scheduler, launch, until
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.host_metrics import HostCollector
from trainyard_agent.metrics import DCGM_FIELDS, GPU_LABELS, GpuHolder
from trainyard_agent.model import Health, Vendor
from trainyard_agent.nvml.profiles import get_profile
from trainyard_agent.workers.supervisor import Supervisor
from trainyard_core.testing.etcd import free_port

PY = sys.executable
README = Path(__file__).resolve().parents[2] / "services" / "node-agent" / "README.md"
H100 = get_profile("h100x8")
NODE = "node-metrics"


def documented_series() -> set[str]:
    """Every series name in the first column of services/node-agent/README.md's metrics tables, and those
    named in its paragraph on the agent's own series."""
    section = README.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([A-Za-z_]+)`", line.split(" | ")[0]))
        elif line.startswith("**The agent itself**"):
            names |= set(re.findall(r"`(trainyard_agent_[a-z_]+)", line))
    return names


def parse(text: str) -> dict[str, list[Sample]]:
    """Samples by name, through the Prometheus text parser (which raises on anything malformed)."""
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def by_gpu(samples: dict[str, list[Sample]], name: str, node: str = NODE) -> dict[int, Sample]:
    found = [s for s in samples.get(name, []) if s.labels.get("node") == node]
    indices = [int(s.labels["gpu"]) for s in found]
    assert len(indices) == len(set(indices)), f"{name}: more than one series for a GPU: {found}"
    return dict(zip(indices, found, strict=True))


@dataclass
class RunningAgent:
    proc: asyncio.subprocess.Process
    grpc_port: int
    metrics_port: int

    async def text(self) -> str:
        def get() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
                assert resp.status == 200
                return str(resp.read().decode())
        # Off the event loop: the scheduler this agent talks to runs on it.
        return await asyncio.to_thread(get)

    async def scrape(self) -> dict[str, list[Sample]]:
        return parse(await self.text())

    async def inject(self, gpu_index: int, kind: str, *, xid: int = 0, count: int = 0, temperature_c: int = 0) -> None:
        """The agent's InjectFault RPC: it changes the fake GPU and returns once the agent has taken it in."""
        req = agent_pb2.InjectFaultRequest(gpu_index=gpu_index, kind=kind, xid=xid, count=count,
                                           temperature_c=temperature_c)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            await agent_pb2_grpc.AgentServiceStub(channel).InjectFault(req)


@pytest.fixture
async def running_agent(tmp_path: Path, scheduler: Scheduler) -> AsyncIterator[RunningAgent]:
    ready = tmp_path / "ready.json"
    metrics_port = free_port()
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "trainyard_agent.main", "--gpu-profile", "h100x8", "--node-id", NODE, "--insecure-plaintext",
        "--single-tenant", "--state-dir", str(tmp_path / "state"), "--ready-file", str(ready),
        "--kill-workers-on-stop", "--scheduler-address", scheduler.address, "--stop-grace-s", "2",
        "--heartbeat-interval-s", "0.2", "--metrics-port", str(metrics_port), "--worker-env", "GLOO_SOCKET_IFNAME=lo",
        stderr=asyncio.subprocess.DEVNULL)
    try:
        await until(lambda: ready.exists() or proc.returncode is not None, "the ready file", timeout=60)
        assert proc.returncode is None, f"the agent exited with code {proc.returncode}"
        await scheduler.registered(NODE, timeout=30)
        yield RunningAgent(proc, json.loads(ready.read_text())["grpc_port"], metrics_port)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_metrics_endpoint_has_the_documented_series_with_dcgm_labels(running_agent: RunningAgent) -> None:
    text = await running_agent.text()
    samples = parse(text)
    # A counter nothing has counted yet (XIDs, worker exits) is declared, with no sample.
    declared = {f.name for f in text_string_to_metric_families(text)}
    families = declared | {f"{n}_total" for n in declared} | set(samples)
    documented = documented_series()
    assert {"DCGM_FI_DEV_GPU_UTIL", "trainyard_agent_host_cpu_seconds_total",
            "trainyard_agent_workers_running"} <= documented
    # InfiniBand needs /sys/class/infiniband (tested below with a fake one); the rest must all be here.
    expected = {n for n in documented if "infiniband" not in n}
    assert not expected - families, f"documented but not exported: {sorted(expected - families)}"

    for field in DCGM_FIELDS:
        gpus = by_gpu(samples, field.name)
        assert sorted(gpus) == list(range(8)), field.name
        for index, s in gpus.items():
            assert set(s.labels) == set(GPU_LABELS), s
            assert s.labels["UUID"].startswith("GPU-") and s.labels["device"] == f"nvidia{index}"
            assert s.labels["modelName"] == "NVIDIA H100 80GB HBM3" and s.labels["Hostname"] == NODE
            assert s.labels["pci_bus_id"] and (s.labels["job"], s.labels["team"]) == ("", "")
    used, free = by_gpu(samples, "DCGM_FI_DEV_FB_USED"), by_gpu(samples, "DCGM_FI_DEV_FB_FREE")
    assert all(used[i].value + free[i].value == H100.memory_mib for i in range(8))
    assert {s.value for s in by_gpu(samples, "DCGM_FI_DEV_POWER_USAGE").values()} == {H100.idle_power_w}
    assert {s.value for s in by_gpu(samples, "DCGM_FI_DEV_XID_ERRORS").values()} == {0}
    assert len({s.labels["UUID"] for s in by_gpu(samples, "DCGM_FI_DEV_GPU_TEMP").values()}) == 8

    # The host's series are served by the same endpoint, with this machine's values.
    memory = samples["trainyard_agent_host_memory_total_bytes"][0].value
    assert 0 < samples["trainyard_agent_host_memory_available_bytes"][0].value <= memory
    assert sum(s.value for s in samples["trainyard_agent_host_cpu_seconds_total"]) > 0


async def test_values_set_in_the_fake_gpus_are_scraped(running_agent: RunningAgent) -> None:
    before = await running_agent.scrape()
    assert by_gpu(before, "DCGM_FI_DEV_GPU_TEMP")[3].value < H100.slowdown_c
    # The agent's fault injection sets the fake GPU's temperature; at the slowdown temperature its clocks drop.
    await running_agent.inject(gpu_index=3, kind="thermal", temperature_c=H100.slowdown_c + 7)
    after = await running_agent.scrape()
    assert by_gpu(after, "DCGM_FI_DEV_GPU_TEMP")[3].value == H100.slowdown_c + 7
    assert by_gpu(after, "DCGM_FI_DEV_SM_CLOCK")[3].value == H100.sm_clock_mhz // 2
    throttled = {(s.labels["gpu"], s.labels["reason"]): s.value for s in after["trainyard_agent_gpu_clock_throttled"]
                 if s.labels["node"] == NODE}
    assert throttled[("3", "hw_thermal")] == 1 and throttled[("2", "hw_thermal")] == 0
    assert by_gpu(after, "DCGM_FI_DEV_GPU_TEMP")[2].value == by_gpu(before, "DCGM_FI_DEV_GPU_TEMP")[2].value

    await running_agent.inject(gpu_index=1, kind="ecc", count=3)
    ecc = await running_agent.scrape()
    assert by_gpu(ecc, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")[1].value == 3
    assert by_gpu(ecc, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL")[1].value == 3
    assert by_gpu(ecc, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")[0].value == 0


async def test_an_injected_xid_shows_as_the_last_xid(running_agent: RunningAgent) -> None:
    # Application XIDs (the GPU stays healthy), then one that takes the GPU out of service.
    await running_agent.inject(gpu_index=5, kind="xid", xid=43)
    await running_agent.inject(gpu_index=5, kind="xid", xid=13)
    await running_agent.inject(gpu_index=6, kind="xid", xid=48)
    samples = await running_agent.scrape()
    xid = {i: s.value for i, s in by_gpu(samples, "DCGM_FI_DEV_XID_ERRORS").items()}
    assert xid == {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 13, 6: 48, 7: 0}
    counts = {(s.labels["gpu"], s.labels["xid"]): s.value for s in samples["trainyard_agent_gpu_xid_total"]
              if s.labels["node"] == NODE}
    assert counts == {("5", "43"): 1, ("5", "13"): 1, ("6", "48"): 1}
    health = {i: s.value for i, s in by_gpu(samples, "trainyard_agent_gpu_health").items()}
    assert health[5] == 1 and health[6] == 3


async def test_a_gpu_held_by_a_job_carries_its_job_and_team_until_the_job_ends(
        running_agent: RunningAgent, scheduler: Scheduler, tmp_path: Path) -> None:
    release = tmp_path / "release"
    job_id = await scheduler.submit([PY, "-c", "import os, time\n"
                                     f"while not os.path.exists({str(release)!r}): time.sleep(0.05)"], gpus=2)
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING, timeout=30)
    held = {i for p in job.placement if p.node_id == NODE for i in p.gpu_indices}
    assert len(held) == 2

    # The labels change when the workers start, which is before the scheduler hears they run.
    samples = await running_agent.scrape()
    for field in DCGM_FIELDS:
        labels = {i: (s.labels["job"], s.labels["team"]) for i, s in by_gpu(samples, field.name).items()}
        assert labels == {i: ((job_id, "agent-tests") if i in held else ("", "")) for i in range(8)}, field.name
    health = by_gpu(samples, "trainyard_agent_gpu_health")
    assert {i for i, s in health.items() if s.labels["job"] == job_id} == held

    release.touch()
    await scheduler.job_in(job_id, types_pb2.JOB_STATE_SUCCEEDED, timeout=30)
    # The agent clears the labels as it records the exits, before it reports them: by now they are gone.
    after = await running_agent.scrape()
    assert not [s for series in after.values() for s in series if s.labels.get("job") == job_id]
    for field in DCGM_FIELDS:
        gpus = by_gpu(after, field.name)
        assert sorted(gpus) == list(range(8)), f"{field.name}: one series per GPU, none left over"
        assert {(s.labels["job"], s.labels["team"]) for s in gpus.values()} == {("", "")}, field.name


async def test_every_fake_nvml_value_reaches_its_dcgm_series(agent: AgentApp) -> None:
    """Each field from its own NVML value: a value mapped to the wrong series shows here."""
    assert agent.fake is not None and agent.monitor is not None
    fake = agent.fake
    fake.set_load(4, 87, 40_000)
    fake.add_ecc_errors(4, 5, corrected=True)
    fake.add_ecc_errors(4, 2)
    fake.set_memory_repair(4, pending=True)
    fake.add_link_errors(4, pcie_replays=9)
    for count, counter in enumerate((pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                                     pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
                                     pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA), start=11):
        fake.add_link_errors(4, nvlink=count, nvlink_counter=counter)
    await agent.monitor.poll_once(counters=True)

    samples = parse(generate_latest(REGISTRY).decode())
    got = {f.name: by_gpu(samples, f.name, "node-a")[4].value for f in DCGM_FIELDS}
    assert got == {
        "DCGM_FI_DEV_GPU_UTIL": 87, "DCGM_FI_DEV_FB_USED": 40_000, "DCGM_FI_DEV_FB_FREE": H100.memory_mib - 40_000,
        "DCGM_FI_DEV_GPU_TEMP": fake.gpus[4].temperature_c, "DCGM_FI_DEV_POWER_USAGE": H100.idle_power_w,
        "DCGM_FI_DEV_SM_CLOCK": H100.sm_clock_mhz, "DCGM_FI_DEV_MEM_CLOCK": H100.memory_clock_mhz,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 5, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": 2,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 9,
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": 11, "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": 12,
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 13, "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": 14,
        "DCGM_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_TOTAL": 15,
        "DCGM_FI_DEV_ROW_REMAP_PENDING": 1, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0, "DCGM_FI_DEV_RETIRED_PENDING": 0}
    # The other GPUs kept their own values.
    assert by_gpu(samples, "DCGM_FI_DEV_GPU_UTIL", "node-a")[3].value == 0
    assert by_gpu(samples, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "node-a")[3].value == 0

    # A GPU that falls off the bus has no values any more; its last XID and its health remain.
    fake.fall_off_bus(4)
    await agent.monitor.poll_once(counters=False)
    await until(lambda: agent.monitor is not None and agent.monitor.xids_seen.get(4), "the XID 79 event")
    lost = parse(generate_latest(REGISTRY).decode())
    assert sorted(by_gpu(lost, "DCGM_FI_DEV_GPU_UTIL", "node-a")) == [0, 1, 2, 3, 5, 6, 7]
    assert by_gpu(lost, "DCGM_FI_DEV_XID_ERRORS", "node-a")[4].value == 79
    assert by_gpu(lost, "trainyard_agent_gpu_health", "node-a")[4].value == 3

    # A stopped agent leaves no GPU series behind.
    await agent.monitor.stop()
    assert not by_gpu(parse(generate_latest(REGISTRY).decode()), "DCGM_FI_DEV_XID_ERRORS", "node-a")


async def test_the_team_of_adopted_workers_survives_an_agent_restart(tmp_path: Path) -> None:
    """The team is kept in the workers' record: a later agent life labels the GPUs it adopts with it."""
    state = tmp_path / "state"

    def life() -> Supervisor:
        healthy = [(Health.HEALTHY, "")] * 4
        return Supervisor(state_dir=state, node_id="node-a", vendor=Vendor.NVIDIA, gpu_health=lambda: healthy,
                          base_env=dict(os.environ), site_env={}, stop_grace_s=1.0, log_max_bytes=1 << 20,
                          log_backups=2, restart_policy="adopt")

    first = life()
    req = replace(launch("job-team", [PY, "-c", "import time; time.sleep(300)"], ranks=2, gpus_per_rank=2),
                  team="ml")
    await first.launch(req)
    holders = {i: GpuHolder("job-team", "ml") for i in range(4)}
    assert first.gpu_holders() == holders
    await first.close()  # the agent goes away; the workers keep running
    second = life()
    try:
        await second.recover()
        assert second.gpu_holders() == holders
    finally:
        await second.close(kill=True)
    assert second.gpu_holders() == {}


# --- the host's series ------------------------------------------------------------------------------------------

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier
    lo: 5000 50 0 0 0 0 0 0 5000 50 0 0 0 0 0 0
{rows}"""
STAT = """cpu  1000 20 300 50000 40 5 60 7 0 0
cpu0 500 10 150 25000 20 3 30 4 0 0
cpu1 500 10 150 25000 20 2 30 3 0 0
intr 12345 0 0
ctxt 99
"""
MEMINFO = "MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n"


def nic_row(name: str, n: int) -> str:
    return f"{name:>6}: {n * 1000} {n * 10} 0 0 0 0 0 0 {n * 2000} {n * 20} 0 0 0 0 0 0"


def fake_host(root: Path, nics: dict[str, str], ib: dict[tuple[str, str], dict[str, str]]) -> tuple[Path, Path]:
    """A /proc and a /sys under `root`: `nics` maps an interface to "pci" or "virtual" (where /sys/class/net
    links it); `ib` maps (device, port) to its counter files."""
    proc, sys_root = root / "proc", root / "sys"
    (proc / "net").mkdir(parents=True)
    rows = "\n".join(nic_row(name, i + 1) for i, name in enumerate(nics))
    (proc / "net" / "dev").write_text(NET_DEV.format(rows=rows) + "\n")
    (proc / "stat").write_text(STAT)
    (proc / "meminfo").write_text(MEMINFO)
    class_net = sys_root / "class" / "net"
    class_net.mkdir(parents=True)
    for name, kind in nics.items():
        parent = "devices/virtual/net" if kind == "virtual" else "devices/pci0000:00/0000:00:03.0/net"
        (sys_root / parent / name).mkdir(parents=True)
        (class_net / name).symlink_to(Path("../..") / parent / name)
    for (device, port), files in ib.items():
        counters = sys_root / "class" / "infiniband" / device / "ports" / port / "counters"
        counters.mkdir(parents=True)
        for file, text in files.items():
            (counters / file).write_text(text)
    return proc, sys_root


def scrape_host(collector: HostCollector) -> dict[str, list[Sample]]:
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def values(samples: dict[str, list[Sample]], name: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[k] for k in labels): s.value for s in samples.get(name, [])}


def test_host_series_from_a_fake_proc_and_sys(tmp_path: Path) -> None:
    nics = {"veth0a": "virtual", "eno1": "pci", "bond0": "virtual", "ib0": "pci", "vethff": "virtual",
            "docker0": "virtual"}
    ib = {("mlx5_0", "1"): {"port_rcv_data": "1000\n", "port_xmit_data": "250\n", "port_rcv_packets": "40\n",
                            "port_xmit_packets": "30\n"},
          ("mlx5_1", "1"): {"port_rcv_data": "8\n", "port_xmit_data": "4\n"}}
    proc, sys_root = fake_host(tmp_path, nics, ib)
    samples = scrape_host(HostCollector(proc, sys_root, max_interfaces=4, ticks_per_s=100))

    # Physical first, then virtual, then veth, each by name; lo never; the cap leaves out the rest and says so.
    rx = values(samples, "trainyard_agent_host_network_receive_bytes_total", "device")
    assert rx == {("eno1",): 2000, ("ib0",): 4000, ("bond0",): 3000, ("docker0",): 6000}
    assert values(samples, "trainyard_agent_host_network_transmit_bytes_total", "device")[("eno1",)] == 4000
    assert values(samples, "trainyard_agent_host_network_receive_packets_total", "device")[("ib0",)] == 40
    assert values(samples, "trainyard_agent_host_network_transmit_packets_total", "device")[("bond0",)] == 60
    assert samples["trainyard_agent_host_network_interfaces_omitted"][0].value == 2

    # InfiniBand data counters are 4-byte words; a port without packet counters has no packet series.
    ib_rx = values(samples, "trainyard_agent_host_infiniband_receive_bytes_total", "device", "port")
    assert ib_rx == {("mlx5_0", "1"): 4000, ("mlx5_1", "1"): 32}
    assert values(samples, "trainyard_agent_host_infiniband_transmit_bytes_total", "device", "port") == {
        ("mlx5_0", "1"): 1000, ("mlx5_1", "1"): 16}
    assert values(samples, "trainyard_agent_host_infiniband_receive_packets_total", "device", "port") == {
        ("mlx5_0", "1"): 40}

    assert values(samples, "trainyard_agent_host_cpu_seconds_total", "mode") == {
        ("user",): 10.0, ("nice",): 0.2, ("system",): 3.0, ("idle",): 500.0, ("iowait",): 0.4, ("irq",): 0.05,
        ("softirq",): 0.6, ("steal",): 0.07}
    assert samples["trainyard_agent_host_cpus"][0].value == 2
    assert samples["trainyard_agent_host_memory_total_bytes"][0].value == 16384 * 1024
    assert samples["trainyard_agent_host_memory_available_bytes"][0].value == 8192 * 1024
    assert set(values(samples, "trainyard_agent_host_read_errors_total", "source").values()) == {0}


def test_unreadable_host_files_cost_their_own_series_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc, sys_root = fake_host(tmp_path, {"eno1": "pci"}, {("mlx5_0", "1"): {"port_rcv_data": "12\n",
                                                                             "port_xmit_data": "n/a\n"}})
    (proc / "stat").write_text("cpu  12 x 3\n")
    (proc / "meminfo").write_text("MemTotal: 100 kB\n")
    collector = HostCollector(proc, sys_root, ticks_per_s=100)
    with caplog.at_level(logging.WARNING, logger="trainyard_agent.host_metrics"):
        samples = scrape_host(collector)
        again = scrape_host(collector)
    assert "trainyard_agent_host_cpu_seconds_total" not in samples
    assert "trainyard_agent_host_memory_total_bytes" not in samples
    assert "trainyard_agent_host_infiniband_receive_bytes_total" not in samples
    assert values(samples, "trainyard_agent_host_network_receive_bytes_total", "device") == {("eno1",): 1000}
    assert values(again, "trainyard_agent_host_read_errors_total", "source") == {
        ("net",): 0, ("infiniband",): 2, ("cpu",): 2, ("memory",): 2}
    # Logged once per source, naming what is wrong, not at every scrape.
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3
    assert any("MemAvailable" in w for w in warnings) and any("port_xmit_data holds 'n/a'" in w for w in warnings)

    (proc / "meminfo").write_text(MEMINFO)
    assert scrape_host(collector)["trainyard_agent_host_memory_available_bytes"][0].value == 8192 * 1024


def test_host_series_of_this_machine_are_plausible() -> None:
    samples = scrape_host(HostCollector())
    total = samples["trainyard_agent_host_memory_total_bytes"][0].value
    assert total == pytest.approx(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), rel=0.01)
    assert 0 < samples["trainyard_agent_host_memory_available_bytes"][0].value <= total
    assert 1 <= samples["trainyard_agent_host_cpus"][0].value <= (os.cpu_count() or 1)
    cpu = values(samples, "trainyard_agent_host_cpu_seconds_total", "mode")
    assert cpu[("idle",)] > 0 and cpu[("user",)] + cpu[("system",)] > 0
    # Every interface the kernel lists but the loopback one, and nothing else.
    listed = set(os.listdir("/sys/class/net")) - {"lo"}
    exported = {k[0] for k in values(samples, "trainyard_agent_host_network_receive_bytes_total", "device")}
    assert exported == listed or (len(exported) == 32 and exported < listed)
    assert all(s.value >= 0 for s in samples["trainyard_agent_host_network_transmit_bytes_total"])
    assert "trainyard_agent_host_infiniband_receive_bytes_total" not in samples or os.path.isdir(
        "/sys/class/infiniband")
    assert set(values(samples, "trainyard_agent_host_read_errors_total", "source").values()) == {0}
