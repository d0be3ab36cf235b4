"""Pure topology arithmetic over what NVML reports: NVLink islands, NVLinks per GPU pair, CPU sets.

NVML describes NVLink one link at a time: each active link of a GPU ends at a PCI device, either another
GPU (a direct link: HGX A100 4-GPU boards, AMD xGMI meshes) or an NVSwitch (HGX 8-GPU boards). An island is
a connected component of the graph GPUs ↔ link endpoints: two GPUs are in one island when a chain of links
and switches joins them. No NVML here, so the rules are tested with plain tables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

# (domain, bus, device): a PCI device whatever the function or the spelling of its bus id string.
PciKey = tuple[int, int, int]


class _UnionFind:
    def __init__(self) -> None:
        self._parent: dict[object, object] = {}

    def find(self, x: object) -> object:
        self._parent.setdefault(x, x)
        root = x
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[x] != root:  # path compression
            self._parent[x], x = root, self._parent[x]
        return root

    def union(self, a: object, b: object) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[rb] = ra


def nvlink_islands(gpus: Sequence[PciKey], remotes: Sequence[Sequence[PciKey]]) -> list[int]:
    """Island id per GPU (0, 1, ... in order of each island's lowest GPU index), -1 for a GPU without an
    active link. `remotes[i]` lists the far end of each active link of GPU i."""
    uf = _UnionFind()
    gpu_of = {key: i for i, key in enumerate(gpus)}
    linked: set[int] = set()
    for i, ends in enumerate(remotes):
        for end in ends:
            peer = gpu_of.get(end)
            # A far end that is one of our GPUs joins the two (even if only one side reports the link);
            # anything else (an NVSwitch) joins every GPU that reaches it.
            uf.union(("gpu", i), ("gpu", peer) if peer is not None else ("switch", end))
            linked.add(i)
            if peer is not None:
                linked.add(peer)
    ids: dict[object, int] = {}
    out = []
    for i in range(len(gpus)):
        if i not in linked:
            out.append(-1)
            continue
        root = uf.find(("gpu", i))
        out.append(ids.setdefault(root, len(ids)))
    return out


def nvlinks_between(gpus: Sequence[PciKey], remotes: Sequence[Sequence[PciKey]], a: int, b: int) -> int:
    """NVLinks joining GPUs a and b: direct links, plus, through each switch both reach, as many links as
    the thinner side has to it (what `nvidia-smi topo -m` shows as NV18 on an HGX H100)."""
    gpu_keys = set(gpus)
    direct = sum(1 for end in remotes[a] if end == gpus[b])
    to_switch_a = Counter(end for end in remotes[a] if end not in gpu_keys)
    to_switch_b = Counter(end for end in remotes[b] if end not in gpu_keys)
    switched = sum(min(n, to_switch_b[sw]) for sw, n in to_switch_a.items())
    return direct + switched


def cpus_from_mask(words: Iterable[int]) -> tuple[int, ...]:
    """CPU numbers from nvmlDeviceGetCpuAffinity's array of 64-bit words (CPU n is bit n % 64 of word
    n // 64)."""
    cpus = []
    for w, word in enumerate(words):
        value = int(word)
        bit = 0
        while value:
            if value & 1:
                cpus.append(w * 64 + bit)
            value >>= 1
            bit += 1
    return tuple(cpus)


def mask_from_cpus(cpus: Iterable[int], words: int) -> list[int]:
    """The inverse of `cpus_from_mask`, `words` long; CPUs beyond it are dropped (as NVML does)."""
    out = [0] * words
    for cpu in cpus:
        if 0 <= cpu < words * 64:
            out[cpu // 64] |= 1 << (cpu % 64)
    return out


def parse_bus_id(bus_id: str) -> PciKey:
    """'00000000:18:00.0' (or the legacy '0000:18:00.0') → (0, 0x18, 0)."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device = rest.split(".")[0]
        return int(domain, 16), int(bus, 16), int(device, 16)
    except ValueError:
        raise ValueError(f"not a PCI bus id: {bus_id!r}") from None
