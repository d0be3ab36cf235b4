"""The NVML adapter against the fake NVML for every profile (inventory, topology, NUMA, metrics, counters,
events), and the fake against pynvml's own API. The real-GPU test at the end runs where NVML is present."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pynvml
import pytest

from trainyard_agent.backend import DeviceEvent, EventKind
from trainyard_agent.model import Health, Vendor
from trainyard_agent.nvml.adapter import NvmlAdapter, NvmlUnavailable
from trainyard_agent.nvml.api import NvmlModule
from trainyard_agent.nvml.fake import FakeNvml
from trainyard_agent.nvml.profiles import PROFILES

EXPECTED = {
    # profile: (count, vendor, model, memory_mb, capability, driver, cuda)
    "h100x8": (8, Vendor.NVIDIA, "H100-80GB-HBM3", 81559, "9.0", "550.90.07", "12.4"),
    "a100x8": (8, Vendor.NVIDIA, "A100-SXM4-80GB", 81920, "8.0", "535.183.01", "12.2"),
    "a100x4": (4, Vendor.NVIDIA, "A100-SXM4-40GB", 40960, "8.0", "535.183.01", "12.2"),
    "l40sx4": (4, Vendor.NVIDIA, "L40S", 46068, "8.9", "550.90.07", "12.4"),
    "mi300x8": (8, Vendor.AMD, "Instinct-MI300X", 196592, "9.4", "6.7.0", ""),
    "cpu": (0, Vendor.NVIDIA, "", 0, "", "", ""),
}

# profile: (islands, NVLinks between two GPUs of an island, PCIe level of each pair (a, b) a < b)
S, N, P, X = "SYS", "NODE", "PXB", "PIX"
TOPOLOGY = {
    # HGX H100: one island through 4 NVSwitches, NV18; each GPU on its own host bridge.
    "h100x8": ([0] * 8, 18, {(a, b): N if a // 4 == b // 4 else S for a in range(8) for b in range(a + 1, 8)}),
    # HGX A100: one island through 6 NVSwitches, NV12; pairs share a two-level PCIe switch.
    "a100x8": ([0] * 8, 12, {(a, b): (P if a // 2 == b // 2 else N) if a // 4 == b // 4 else S
                             for a in range(8) for b in range(a + 1, 8)}),
    "a100x4": ([0] * 4, 4, {(0, 1): P, (2, 3): P, (0, 2): N, (0, 3): N, (1, 2): N, (1, 3): N}),
    # PCIe only: no island; socket 0 two leaves under one switch, socket 1 one switch for both.
    "l40sx4": ([-1] * 4, 0, {(0, 1): P, (2, 3): X, (0, 2): S, (0, 3): S, (1, 2): S, (1, 3): S}),
    # AMD xGMI mesh modelled as one island, one link per pair.
    "mi300x8": ([0] * 8, 1, {(a, b): N if a // 4 == b // 4 else S for a in range(8) for b in range(a + 1, 8)}),
    "cpu": ([], 0, {}),
}
NUMA = {"h100x8": [0, 0, 0, 0, 1, 1, 1, 1], "a100x8": [0, 0, 0, 0, 1, 1, 1, 1], "a100x4": [0, 0, 0, 0],
        "l40sx4": [0, 0, 1, 1], "mi300x8": [0, 0, 0, 0, 1, 1, 1, 1], "cpu": []}


def opened(profile: str, *, host_cpus: int = 64, seed: str = "node-a") -> tuple[FakeNvml, NvmlAdapter]:
    fake = FakeNvml(profile, seed=seed, host_cpus=host_cpus)
    adapter = NvmlAdapter(fake, fake.vendor, host_cpus=host_cpus)
    adapter.open()
    return fake, adapter


def test_every_profile_is_covered() -> None:
    assert set(EXPECTED) == set(PROFILES) == set(TOPOLOGY) == set(NUMA)


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_inventory_of_each_profile(profile: str) -> None:
    count, vendor, model, memory_mb, capability, driver, cuda = EXPECTED[profile]
    _, adapter = opened(profile)
    try:
        inv = adapter.inventory()
    finally:
        adapter.close()
    assert inv.vendor is vendor and inv.driver_version == driver and inv.runtime_version == cuda
    assert len(inv.accelerators) == count
    assert [g.index for g in inv.accelerators] == list(range(count))
    for g in inv.accelerators:
        assert (g.vendor, g.model, g.memory_mb, g.capability) == (vendor, model, memory_mb, capability)
        assert g.name == PROFILES[profile].device_name
        assert g.pci_bus_id.startswith("00000000:") and g.pci_bus_id.endswith(":00.0")
        assert not g.mig_enabled and g.health is Health.HEALTHY
    assert len({g.uuid for g in inv.accelerators}) == count
    assert len({g.pci_bus_id for g in inv.accelerators}) == count
    if count and vendor is Vendor.NVIDIA:
        assert all(g.uuid.startswith("GPU-") for g in inv.accelerators)


@pytest.mark.parametrize("profile", sorted(TOPOLOGY))
def test_topology_of_each_profile(profile: str) -> None:
    islands, nvlinks, levels = TOPOLOGY[profile]
    _, adapter = opened(profile)
    inv = adapter.inventory()
    assert [g.nvlink_island for g in inv.accelerators] == islands
    assert {(x.gpu_a, x.gpu_b): x.level for x in inv.links} == levels
    assert {x.nvlinks for x in inv.links} <= {nvlinks}


@pytest.mark.parametrize("profile", sorted(NUMA))
def test_numa_node_and_cpu_affinity_of_each_profile(profile: str) -> None:
    # A simulated 2-socket host with 64 CPUs: GPUs of socket 0 are close to CPUs 0-31, of socket 1 to 32-63.
    _, adapter = opened(profile, host_cpus=64)
    gpus = adapter.inventory().accelerators
    assert [g.numa_node for g in gpus] == NUMA[profile]
    sockets = len(set(NUMA[profile])) or 1
    per = 64 // sockets
    for g in gpus:
        assert g.cpu_affinity == tuple(range(g.numa_node * per, (g.numa_node + 1) * per))


def test_cpu_affinity_beyond_64_cpus_spans_several_words() -> None:
    _, adapter = opened("h100x8", host_cpus=256)
    gpus = adapter.inventory().accelerators
    assert gpus[0].cpu_affinity == tuple(range(128)) and gpus[7].cpu_affinity == tuple(range(128, 256))


def test_two_simulated_nodes_never_share_gpu_uuids() -> None:
    a, b = FakeNvml("h100x8", seed="node-a"), FakeNvml("h100x8", seed="node-b")
    assert not {g.uuid for g in a.gpus} & {g.uuid for g in b.gpus}


def test_mig_mode_is_read() -> None:
    fake, adapter = opened("a100x8")
    fake.set_mig_mode(2, True)
    assert [g.mig_enabled for g in adapter.inventory().accelerators] == [i == 2 for i in range(8)]


def test_metrics_clocks_throttle_and_a_gpu_that_falls_off_the_bus() -> None:
    fake, adapter = opened("a100x4")
    fake.set_load(1, utilization_percent=87, memory_used_mib=30000)
    sample = adapter.sample(counters=False)
    assert [m.index for m in sample.metrics] == [0, 1, 2, 3] and not sample.lost and not sample.counters
    m1 = sample.metrics[1]
    assert (m1.utilization_percent, m1.memory_used_mb, m1.power_w) == (87, 30000, 55)
    assert (m1.sm_clock_mhz, m1.memory_clock_mhz, m1.throttle_reasons) == (1410, 1215, ())
    assert 30 < m1.temperature_c < 40

    fake.set_temperature(0, 92)  # the part slows itself down
    hot = adapter.sample(counters=False).metrics[0]
    assert hot.temperature_c == 92 and hot.sm_clock_mhz == 705
    assert set(hot.throttle_reasons) == {"hw_slowdown", "hw_thermal", "sw_thermal"}

    fake.fall_off_bus(2)
    sample = adapter.sample(counters=True)
    assert [m.index for m in sample.metrics] == [0, 1, 3] and sorted(sample.counters) == [0, 1, 3]
    assert "GpuIsLost" in sample.lost[2]


def test_health_counters_with_row_remapping() -> None:
    fake, adapter = opened("h100x8")
    adapter.inventory()  # finds the active NVLinks, whose error counters are then read
    fake.add_ecc_errors(3, 4)
    fake.add_ecc_errors(3, 7, corrected=True)
    fake.set_memory_repair(3, pending=True)
    fake.add_link_errors(3, nvlink=5, pcie_replays=2)
    c = adapter.sample(counters=True).counters[3]
    assert (c.ecc_volatile_uncorrected, c.ecc_aggregate_uncorrected, c.ecc_volatile_corrected) == (4, 4, 7)
    assert c.remapped_rows_pending and not c.remapped_rows_failure
    assert (c.retired_pages, c.retired_pages_pending) == (0, False)
    assert (c.nvlink_errors, c.pcie_replays) == (5, 2)
    assert adapter.sample(counters=True).counters[0] == type(c)()


def test_health_counters_with_page_retirement() -> None:
    # Parts before Ampere (and AMD's) retire bad pages instead of remapping rows.
    fake = FakeNvml(replace(PROFILES["a100x8"], memory_repair="page_retire"))
    adapter = NvmlAdapter(fake)
    adapter.open()
    fake.add_ecc_errors(1, 3)
    c = adapter.sample(counters=True).counters[1]
    assert (c.retired_pages, c.retired_pages_pending, c.remapped_rows_pending) == (3, True, False)


def test_unsupported_fields_are_defaults_and_not_asked_again() -> None:
    calls: list[str] = []

    class Counting(FakeNvml):
        # Wraps the fake to count calls (not a new fake: every answer is the fake NVML's).
        def nvmlDeviceGetMigMode(self, device: object) -> list[int]:
            calls.append("mig")
            return super().nvmlDeviceGetMigMode(device)

        def nvmlDeviceGetRemappedRows(self, device: object) -> tuple[int, int, int, int]:
            calls.append("remap")
            return super().nvmlDeviceGetRemappedRows(device)

    fake = Counting("mi300x8")  # no MIG, no row remapping on this part
    adapter = NvmlAdapter(fake, fake.vendor)
    adapter.open()
    assert not any(g.mig_enabled for g in adapter.inventory().accelerators)
    for _ in range(3):
        adapter.sample(counters=True)
    assert calls.count("mig") == 8 and calls.count("remap") == 8  # once per GPU, then remembered


def test_the_fake_requires_init_like_nvml() -> None:
    fake = FakeNvml("h100x8")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_handles_are_pointers_and_foreign_ones_are_refused() -> None:
    fake = FakeNvml("h100x8")
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    other = FakeNvml("h100x8")
    other.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetName(other.nvmlDeviceGetHandleByIndex(0))  # another host's GPU
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(8)


# --- events ----------------------------------------------------------------------------------------------


def test_xids_are_delivered_through_the_event_set() -> None:
    fake, adapter = opened("h100x8")
    source = adapter.events()
    assert source is not None and sorted(source.registered) == list(range(8))
    try:
        assert source.wait(0.05) == []  # nothing happened: a timeout, not an error
        fake.inject_xid(3, 79)
        fake.inject_xid(5, 13)
        fake.add_ecc_errors(6, 1)
        events = source.wait(1.0)
        assert events == [DeviceEvent(3, EventKind.XID, 79), DeviceEvent(5, EventKind.XID, 13),
                          DeviceEvent(6, EventKind.ECC_UNCORRECTED, 0)]
        fake.fall_off_bus(1)  # the GPU no longer answers, but its XID 79 is matched by handle
        assert source.wait(1.0) == [DeviceEvent(1, EventKind.XID, 79)]
        fake.set_memory_repair(2, failure=True)
        assert source.wait(1.0) == [DeviceEvent(2, EventKind.MEMORY_RETIREMENT_FAILURE, 0)]
    finally:
        source.close()


def test_a_host_without_gpus_has_no_event_source() -> None:
    _, adapter = opened("cpu")
    assert adapter.events() is None


def test_an_event_set_only_receives_what_it_registered_for() -> None:
    fake = FakeNvml("l40sx4")
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    event_set = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    fake.add_ecc_errors(0, 1)  # not registered for ECC events
    fake.inject_xid(1, 48)  # not registered for GPU 1
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait(event_set, 10)
    fake.inject_xid(0, 48)
    data = fake.nvmlEventSetWait(event_set, 1000)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 48)
    fake.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlEventSetWait(event_set, 0)  # freed


# --- NVML missing, and the API contract ------------------------------------------------------------------


def test_no_nvml_library_is_explained() -> None:
    # This machine has no NVIDIA driver: the real pynvml fails to load libnvidia-ml.so.1.
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - only on a GPU host
        pynvml.nvmlShutdown()
        pytest.skip("NVML is present on this host")
    with pytest.raises(NvmlUnavailable) as info:
        NvmlAdapter(pynvml).open()
    assert "NVMLError_LibraryNotFound" in info.value.message and "--gpu-profile" in info.value.message


def _protocol_functions() -> list[str]:
    return [name for name, value in vars(NvmlModule).items()
            if name.startswith("nvml") and callable(value)]


def test_the_protocol_lists_what_the_fake_implements() -> None:
    fake_functions = {name for name in vars(FakeNvml) if name.startswith("nvml")}
    assert fake_functions == set(_protocol_functions())


@pytest.mark.parametrize("name", _protocol_functions())
def test_fake_and_adapter_use_pynvml_signatures(name: str) -> None:
    """Every function the adapter may call exists in nvidia-ml-py with the same parameters, and the
    fake implements it with exactly those parameters."""
    real = inspect.signature(getattr(pynvml, name))
    fake = inspect.signature(getattr(FakeNvml, name))
    protocol = inspect.signature(getattr(NvmlModule, name))
    names = [p.name for p in real.parameters.values()]
    assert [p.name for p in fake.parameters.values()][1:] == names
    assert [p.name for p in protocol.parameters.values()][1:] == names


def test_a_gpu_lost_before_start_is_listed_unhealthy() -> None:
    fake = FakeNvml("a100x8")
    fake.fall_off_bus(5)
    adapter = NvmlAdapter(fake)
    adapter.open()
    inv = adapter.inventory()
    gpus = inv.accelerators
    assert len(gpus) == 8 and gpus[5].health is Health.UNHEALTHY and "GpuIsLost" in gpus[5].health_reason
    assert all(g.health is Health.HEALTHY for g in gpus if g.index != 5)
    # The others' topology is still read; the lost GPU is in no island and no pair.
    assert gpus[5].nvlink_island == -1 and [g.nvlink_island for g in gpus if g.index != 5] == [0] * 7
    assert all(5 not in (x.gpu_a, x.gpu_b) for x in inv.links) and len(inv.links) == 21
    assert 5 in adapter.sample(counters=False).lost


# --- real hardware ---------------------------------------------------------------------------------------


def _real_nvml_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(not _real_nvml_present(), reason="needs an NVIDIA driver (real NVML)")
def test_real_gpus_through_the_same_adapter() -> None:  # pragma: no cover - GPU hosts only
    adapter = NvmlAdapter(pynvml)
    adapter.open()
    try:
        inv = adapter.inventory()
        sample = adapter.sample(counters=True)
        source = adapter.events()
        events = source.wait(0.2) if source is not None else None
        if source is not None:
            source.close()
    finally:
        adapter.close()
    assert inv.driver_version and inv.accelerators and inv.runtime_version.count(".") == 1
    for g in inv.accelerators:
        assert g.uuid.startswith(("GPU-", "MIG-")) and g.memory_mb > 0 and "." in g.capability
        assert g.pci_bus_id.count(":") == 2
    assert [m.index for m in sample.metrics] == [g.index for g in inv.accelerators] and not sample.lost
    assert sorted(sample.counters) == [g.index for g in inv.accelerators]
    n = len(inv.accelerators)
    assert len(inv.links) == n * (n - 1) // 2
    print({"inventory": inv, "metrics": sample.metrics, "events": events,
           "registered_events": source.registered if source is not None else None})
