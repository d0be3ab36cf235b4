"""Separate hosts on one machine: one Linux network namespace per simulated node, joined by a bridge.

Layout, for a `HostNetwork` with tag `abcd` and subnet 10.231.N.0/24 (N picked free at creation):

    root namespace: bridge tyb-abcd, 10.231.N.1   <- control plane listens here (scheduler, checkpoint-store)
    namespace ty-abcd-0: eth0 10.231.N.10         <- node 0's agent and workers
    namespace ty-abcd-1: eth0 10.231.N.11         <- node 1's ...

Each namespace has its own loopback and one veth whose peer sits on the bridge, so a node reaches the control
plane at the bridge address and the other nodes at theirs, and nothing else: 127.0.0.1 inside a namespace is
that node's own loopback (etcd, on the root namespace's loopback, is out of reach, as it is from a real GPU
host). No route leaves the subnet, so no traffic goes anywhere but to addresses inside namespaces this object
created.

Only what this object created is removed by `close()` (namespaces by name; deleting one destroys its veth pair),
and creation undoes itself when a step fails. It needs root (CAP_NET_ADMIN) and iproute2's `ip`. The network
faults of later chaos work (link down, loss, latency) act on one node's `eth0` through `run_in(node, ...)`.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

SUBNET_BASE = "10.231"
FIRST_HOST = 10
IFNAME = "eth0"


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, or no `ip`)."""


def _ip(*args: str, netns: str | None = None) -> str:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian package iproute2)"
    return None


def _used_third_octets() -> set[int]:
    used: set[int] = set()
    for line in (_ip("-o", "-4", "addr", "show") + _ip("-4", "route", "show", "table", "all")).splitlines():
        for word in line.split():
            try:
                net = ipaddress.ip_network(word, strict=False)
            except ValueError:
                continue
            if net.version == 4 and net.overlaps(ipaddress.ip_network(f"{SUBNET_BASE}.0.0/16")):
                # Any overlap with a /24 of ours rules that /24 out.
                for n in range(256):
                    if net.overlaps(ipaddress.ip_network(f"{SUBNET_BASE}.{n}.0/24")):
                        used.add(n)
    return used


@dataclass(frozen=True, slots=True)
class Host:
    name: str          # the node this namespace stands for
    netns: str         # namespace name
    address: str       # its eth0 address


class HostNetwork:
    """Namespaces for `nodes`, created by `create()` and removed by `close()`."""

    def __init__(self, nodes: Sequence[str]) -> None:
        if len(nodes) > 200:
            raise ValueError("at most 200 namespaces per network")
        self.tag = secrets.token_hex(2)
        self.bridge = f"tyb-{self.tag}"
        self._nodes = list(nodes)
        self.bridge_address = ""
        self.hosts: dict[str, Host] = {}
        self._created_netns: list[str] = []
        self._bridge_made = False

    def create(self) -> HostNetwork:
        reason = available()
        if reason:
            raise NetnsUnavailable(reason)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        free = sorted(set(range(1, 255)) - _used_third_octets())
        if not free:
            raise RuntimeError(f"no free /24 under {SUBNET_BASE}.0.0/16 for test namespaces")
        octet = free[secrets.randbelow(len(free))]
        prefix = f"{SUBNET_BASE}.{octet}"
        self.bridge_address = f"{prefix}.1"
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, node in enumerate(self._nodes):
            netns, veth, address = f"ty-{self.tag}-{i}", f"tyv-{self.tag}-{i}", f"{prefix}.{FIRST_HOST + i}"
            _ip("netns", "add", netns)
            self._created_netns.append(netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", netns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("addr", "add", f"{address}/24", "dev", IFNAME, netns=netns)
            _ip("link", "set", IFNAME, "up", netns=netns)
            _ip("link", "set", "lo", "up", netns=netns)
            self.hosts[node] = Host(name=node, netns=netns, address=address)

    def exec_prefix(self, node: str) -> list[str]:
        """Put in front of a command line to run it on `node`'s host."""
        return ["ip", "netns", "exec", self.hosts[node].netns]

    def run_in(self, node: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run a short command on `node`'s host (e.g. `ip link set eth0 down`); raises when it fails."""
        done = subprocess.run([*self.exec_prefix(node), *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} on {node} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def close(self) -> None:
        """Remove what this object created; idempotent. Deleting a namespace destroys its veth pair."""
        errors = []
        for netns in reversed(self._created_netns):
            try:
                _ip("netns", "del", netns)
            except RuntimeError as err:
                errors.append(str(err))
        self._created_netns.clear()
        if self._bridge_made:
            try:
                _ip("link", "del", self.bridge)
            except RuntimeError as err:
                errors.append(str(err))
            self._bridge_made = False
        self.hosts.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> HostNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()
