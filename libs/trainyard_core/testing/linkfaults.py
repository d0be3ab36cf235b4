"""What a network fault does to one host's link, and the `tc` command lines that do it (pure: no I/O here;
`netns.HostNetwork.impair` runs them).

An `Impairment` says what is wrong with a host's link: peers it is cut from (a whole host, or one address and
port), cut from everyone (an isolated host), random loss, latency with jitter. It acts in both directions, on
the two ends of the host's one link, both devices a `HostNetwork` created:

    outbound: the host's `eth0`, in its namespace       (match the peer as destination)
    inbound:  its veth peer on the bridge, root namespace (match the peer as source)

This kernel has neither netem nor the `gact` action (no `tc ... action drop`), so dropping is built from what
it has, HTB, the u32 and BPF classifiers and pfifo:

- an HTB root whose unclassified traffic passes untouched (HTB's `default 0`: the direct queue, no shaping);
- one class, 1:99, whose leaf is a `pfifo limit 0`: it holds nothing, so every packet classified into it is
  dropped — silently, as a cut cable or a dead switch port does, not refused;
- u32 filters classify a cut peer's packets there (`match ip dst A/32 [match ip dport P]` outbound, `src` and
  `sport` inbound); an isolated host's filter matches every frame, ARP included;
- loss is a classic-BPF filter that loads a random 32-bit number (SKF_AD_RANDOM) and classifies the packet
  into the drop class when it is at or above (1 - p) * 2^32: each packet is dropped with probability p, in
  each direction.

No qdisc here can hold a packet back, so latency is done in user space by a delay line (delayline.py): the
host's veth peer leaves the bridge and a tap device takes its place; the delay line carries every frame
between the two after the delay, with jitter that never reorders frames (a frame leaves no earlier than the
one before it). `LATENCY_LIMIT_MS` bounds delay plus jitter so the round trip stays below a second, well inside
the 2 s window in which an agent needs its pulses acknowledged (rpc/pulse.py).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

DROP_CLASS = "1:99"
# A round trip of (delay + jitter) * 2 stays below a second: well inside the 2 s pulse acknowledgement window.
LATENCY_LIMIT_MS = 400.0
# Classic BPF: ld [SKF_AD_OFF + SKF_AD_RANDOM]; jge #K, 0, 1; ret #-1 (the filter's flowid); ret #0 (no match).
_LD_RANDOM = "32 0 0 4294963256"
_RET_MATCH = "6 0 0 4294967295"
_RET_NONE = "6 0 0 0"


@dataclass(frozen=True, slots=True)
class Peer:
    """An address on the host network, and optionally one TCP/UDP port there (0: the whole host)."""

    address: str
    port: int = 0

    def __post_init__(self) -> None:
        ipaddress.IPv4Address(self.address)  # ValueError names the bad address
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not in 0-65535")

    def describe(self) -> str:
        return f"{self.address}:{self.port}" if self.port else self.address


@dataclass(frozen=True, slots=True)
class Impairment:
    cut: tuple[Peer, ...] = ()       # no traffic to or from these
    isolated: bool = False           # no traffic at all
    loss_pct: float = 0.0            # each packet dropped with this probability, each direction
    delay_ms: float = 0.0            # one way, each direction
    jitter_ms: float = 0.0           # uniform in [-jitter, +jitter] around the delay, order kept

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss_pct <= 100.0:
            raise ValueError(f"loss_pct {self.loss_pct} must be within 0-100")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(f"delay_ms {self.delay_ms} and jitter_ms {self.jitter_ms} must be >= 0, jitter at most "
                             "the delay")
        if self.delay_ms + self.jitter_ms > LATENCY_LIMIT_MS:
            raise ValueError(f"delay_ms + jitter_ms ({self.delay_ms + self.jitter_ms:g}) is above "
                             f"{LATENCY_LIMIT_MS:g}: the round trip must stay below a second (pulses need "
                             "acknowledging within 2 s)")

    @property
    def drops(self) -> bool:
        return bool(self.cut) or self.isolated or self.loss_pct > 0

    @property
    def delays(self) -> bool:
        return self.delay_ms > 0

    def describe(self) -> str:
        parts = []
        if self.isolated:
            parts.append("isolated")
        if self.cut:
            parts.append("cut from " + ", ".join(p.describe() for p in self.cut))
        if self.loss_pct:
            parts.append(f"loss {self.loss_pct:.1f}%")
        if self.delay_ms:
            parts.append(f"delay {self.delay_ms:.0f}±{self.jitter_ms:.0f} ms each way")
        return "; ".join(parts) or "none"


def loss_bytecode(loss_pct: float) -> str:
    """The classic-BPF program (tc's `bytecode` form) that matches a packet with probability loss_pct/100."""
    threshold = min(2**32 - 1, max(0, round((1.0 - loss_pct / 100.0) * 2**32)))
    return f"4,{_LD_RANDOM},53 0 1 {threshold},{_RET_MATCH},{_RET_NONE}"


def tc_commands(dev: str, imp: Impairment, *, outbound: bool) -> list[list[str]]:
    """The `tc` argument lists (without `tc` itself) that put `imp`'s drops on `dev`: the host's eth0 when
    `outbound`, else its veth peer on the bridge. [] when `imp` drops nothing (latency is the delay line's)."""
    if not imp.drops:
        return []
    cmds = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"],
            ["class", "add", "dev", dev, "parent", "1:", "classid", DROP_CLASS, "htb", "rate", "8kbit",
             "quantum", "1514"],
            ["qdisc", "add", "dev", dev, "parent", DROP_CLASS, "handle", "99:", "pfifo", "limit", "0"]]
    prio = 1
    if imp.isolated:
        cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", str(prio), "u32",
                     "match", "u32", "0", "0", "flowid", DROP_CLASS])
        prio += 1
    for peer in imp.cut:
        side, port_side = ("dst", "dport") if outbound else ("src", "sport")
        match = ["match", "ip", side, f"{peer.address}/32"]
        if peer.port:
            match += ["match", "ip", port_side, str(peer.port), "0xffff"]
        cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", str(prio), "u32",
                     *match, "flowid", DROP_CLASS])
        prio += 1
    if imp.loss_pct > 0:
        cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", str(prio), "bpf",
                     "bytecode", loss_bytecode(imp.loss_pct), "flowid", DROP_CLASS])
    return cmds


def tc_clear(dev: str) -> list[str]:
    """Removes everything `tc_commands` put on `dev` (the root qdisc takes its classes and filters along)."""
    return ["qdisc", "del", "dev", dev, "root"]
