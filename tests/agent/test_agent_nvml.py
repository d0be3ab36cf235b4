"""The NVML adapter against the fake NVML for every profile, and the fake against pynvml's own API."""

from __future__ import annotations

import inspect

import pynvml
import pytest

from trainyard_agent.model import Vendor
from trainyard_agent.nvml.adapter import NvmlAdapter, NvmlModule, NvmlUnavailable
from trainyard_agent.nvml.fake import FakeNvml
from trainyard_agent.nvml.profiles import PROFILES

EXPECTED = {
    # profile: (count, vendor, model, memory_mb, capability, driver)
    "h100x8": (8, Vendor.NVIDIA, "H100-80GB-HBM3", 81559, "9.0", "550.90.07"),
    "a100x8": (8, Vendor.NVIDIA, "A100-SXM4-80GB", 81920, "8.0", "535.183.01"),
    "a100x4": (4, Vendor.NVIDIA, "A100-SXM4-40GB", 40960, "8.0", "535.183.01"),
    "l40sx4": (4, Vendor.NVIDIA, "L40S", 46068, "8.9", "550.90.07"),
    "mi300x8": (8, Vendor.AMD, "Instinct-MI300X", 196592, "9.4", "6.7.0"),
    "cpu": (0, Vendor.NVIDIA, "", 0, "", ""),
}


def test_every_profile_is_covered() -> None:
    assert set(EXPECTED) == set(PROFILES)


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_inventory_of_each_profile(profile: str) -> None:
    count, vendor, model, memory_mb, capability, driver = EXPECTED[profile]
    fake = FakeNvml(profile, seed="node-a")
    adapter = NvmlAdapter(fake, fake.vendor)
    adapter.open()
    try:
        inv = adapter.inventory()
    finally:
        adapter.close()
    assert inv.vendor is vendor and inv.driver_version == driver
    assert len(inv.accelerators) == count
    assert [g.index for g in inv.accelerators] == list(range(count))
    for g in inv.accelerators:
        assert (g.vendor, g.model, g.memory_mb, g.capability) == (vendor, model, memory_mb, capability)
        assert g.name == PROFILES[profile].device_name
        assert g.pci_bus_id.startswith("00000000:") and g.pci_bus_id.endswith(":00.0")
        assert g.numa_node in (0, 1)
    assert len({g.uuid for g in inv.accelerators}) == count
    assert len({g.pci_bus_id for g in inv.accelerators}) == count
    if count and vendor is Vendor.NVIDIA:
        assert all(g.uuid.startswith("GPU-") for g in inv.accelerators)
        assert inv.runtime_version.count(".") == 1


def test_two_simulated_nodes_never_share_gpu_uuids() -> None:
    a, b = FakeNvml("h100x8", seed="node-a"), FakeNvml("h100x8", seed="node-b")
    assert not {g.uuid for g in a.gpus} & {g.uuid for g in b.gpus}


def test_numa_split_of_a_two_socket_host() -> None:
    adapter = NvmlAdapter(FakeNvml("h100x8"))
    adapter.open()
    assert [g.numa_node for g in adapter.inventory().accelerators] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_metrics_and_a_gpu_that_falls_off_the_bus() -> None:
    fake = FakeNvml("a100x4")
    adapter = NvmlAdapter(fake)
    adapter.open()
    fake.set_load(1, utilization_percent=87, memory_used_mib=30000)
    sample = adapter.metrics()
    assert [m.index for m in sample.metrics] == [0, 1, 2, 3] and not sample.lost
    m1 = sample.metrics[1]
    assert (m1.utilization_percent, m1.memory_used_mb, m1.power_w) == (87, 30000, 55)
    assert 30 < m1.temperature_c < 40

    fake.fall_off_bus(2)
    sample = adapter.metrics()
    assert [m.index for m in sample.metrics] == [0, 1, 3]
    assert "GpuIsLost" in sample.lost[2]


def test_the_fake_requires_init_like_nvml() -> None:
    fake = FakeNvml("h100x8")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


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
        sample = adapter.metrics()
    finally:
        adapter.close()
    assert inv.driver_version and inv.accelerators
    for g in inv.accelerators:
        assert g.uuid.startswith(("GPU-", "MIG-")) and g.memory_mb > 0 and "." in g.capability
        assert g.pci_bus_id.count(":") == 2
    assert [m.index for m in sample.metrics] == [g.index for g in inv.accelerators] and not sample.lost
    print({"inventory": inv, "metrics": sample.metrics})


def test_a_gpu_lost_before_start_is_listed_unhealthy() -> None:
    from trainyard_agent.model import Health

    fake = FakeNvml("a100x8")
    fake.fall_off_bus(5)
    adapter = NvmlAdapter(fake)
    adapter.open()
    gpus = adapter.inventory().accelerators
    assert len(gpus) == 8 and gpus[5].health is Health.UNHEALTHY and "GpuIsLost" in gpus[5].health_reason
    assert all(g.health is Health.HEALTHY for g in gpus if g.index != 5)
    assert 5 in adapter.metrics().lost
