"""Separate hosts on one machine: one Linux network namespace per simulated host, joined by a bridge.

Layout, for a `HostNetwork` with tag `abcd` and subnet 10.231.N.0/24 (N picked free at creation):

    root namespace: bridge tyb-abcd, 10.231.N.1   <- what stays in the root namespace listens here
                    10.231.N.2 ...                <- `root_addresses` more on the bridge (e.g. etcd members)
    namespace ty-abcd-0: eth0 10.231.N.10         <- host 0 (a node's agent and workers, or a service)
    namespace ty-abcd-1: eth0 10.231.N.11         <- host 1 ...

A host is any name: the local cluster gives each node one, and in its control-plane mode each scheduler
replica, the checkpoint-store and the gateway one too. Each namespace has its own loopback and one veth
(`eth0`) whose peer (`tyv-abcd-<i>`) sits on the bridge, so a host reaches the root namespace's addresses on
the bridge and the other hosts at theirs, and nothing else: 127.0.0.1 inside a namespace is that host's own
loopback (anything on the root namespace's loopback is out of reach, as it is from a real GPU host). No
route leaves the subnet, so no traffic goes anywhere but to addresses inside namespaces this object created.
The bridge has a fixed address of its own (a locally administered MAC), so it does not change when ports
come and go (a Linux bridge otherwise takes its lowest port's, and the hosts' ARP entries for it go stale).

Network faults (`impair`, `heal`): an `linkfaults.Impairment` on one host's link — cut from peers, isolated,
random loss, latency — acts on that host's two link ends only, both devices this object created (its
`eth0`, its veth peer), and for latency through a delay line process this object starts (delayline.py)
with a tap device of its own that vanishes with it. `heal` removes what `impair` put there; `close` heals
every host first.

Only what this object created is removed by `close()` (delay lines by process, namespaces by name; deleting
one destroys its veth pair), and creation undoes itself when a step fails. It needs root (CAP_NET_ADMIN) and
iproute2's `ip` and `tc`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .linkfaults import Impairment, tc_clear, tc_commands

SUBNET_BASE = "10.231"
FIRST_HOST = 10
MAX_ROOT_ADDRESSES = FIRST_HOST - 2   # .2 up to .9
IFNAME = "eth0"
DELAY_LINE_READY_S = 20.0


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, or no `ip`)."""


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _ip(*args: str, netns: str | None = None) -> str:
    return _run(["ip", *(("-n", netns) if netns else ()), *args])


def _tc(args: list[str], netns: str | None = None) -> str:
    return _run([*(("ip", "netns", "exec", netns) if netns else ()), "tc", *args])


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian package iproute2)"
    if shutil.which("tc") is None:
        return "iproute2's `tc` is not installed (Debian package iproute2)"
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
    name: str          # the node or service this namespace stands for
    netns: str         # namespace name
    address: str       # its eth0 address
    veth: str          # its link's other end, on the bridge (root namespace)
    tap: str           # the tap device a delay line puts in the veth's place on the bridge


@dataclass
class _DelayLine:
    proc: subprocess.Popen[str]
    veth: str


class HostNetwork:
    """Namespaces for `names` (nodes, services), created by `create()` and removed by `close()`; with
    `root_addresses`, that many more addresses on the bridge for processes left in the root namespace."""

    def __init__(self, names: Sequence[str], *, root_addresses: int = 0) -> None:
        if len(names) > 200:
            raise ValueError("at most 200 namespaces per network")
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {list(names)}")
        if not 0 <= root_addresses <= MAX_ROOT_ADDRESSES:
            raise ValueError(f"root_addresses must be within 0-{MAX_ROOT_ADDRESSES}")
        self.tag = secrets.token_hex(2)
        self.bridge = f"tyb-{self.tag}"
        self._names = list(names)
        self._root_count = root_addresses
        self.bridge_address = ""
        self.root_addresses: list[str] = []
        self.hosts: dict[str, Host] = {}
        self.impairments: dict[str, Impairment] = {}
        self._created_netns: list[str] = []
        self._bridge_made = False
        self._tc_on: set[tuple[str, str | None]] = set()   # (device, namespace) with a qdisc of ours
        self._delay_lines: dict[str, _DelayLine] = {}

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
        # Locally administered, unicast: the bridge keeps it whatever ports join or leave.
        mac = "02:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(5))
        _ip("link", "set", self.bridge, "address", mac)
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        for i in range(self._root_count):
            address = f"{prefix}.{2 + i}"
            _ip("addr", "add", f"{address}/24", "dev", self.bridge)
            self.root_addresses.append(address)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self._names):
            netns, veth, address = f"ty-{self.tag}-{i}", f"tyv-{self.tag}-{i}", f"{prefix}.{FIRST_HOST + i}"
            _ip("netns", "add", netns)
            self._created_netns.append(netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", netns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("addr", "add", f"{address}/24", "dev", IFNAME, netns=netns)
            _ip("link", "set", IFNAME, "up", netns=netns)
            _ip("link", "set", "lo", "up", netns=netns)
            self.hosts[name] = Host(name=name, netns=netns, address=address, veth=veth, tap=f"tyt-{self.tag}-{i}")

    def exec_prefix(self, name: str) -> list[str]:
        """Put in front of a command line to run it on `name`'s host."""
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def run_in(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run a short command on `name`'s host (e.g. `ip link set eth0 down`); raises when it fails."""
        done = subprocess.run([*self.exec_prefix(name), *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} on {name} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    # -- network faults ---------------------------------------------------------------------------------
    def impair(self, name: str, impairment: Impairment) -> None:
        """Put `impairment` on `name`'s link, in place of whatever it had; a step that fails heals the host
        and raises."""
        host = self.hosts[name]
        self.heal(name)
        self.impairments[name] = impairment
        try:
            for dev, netns, outbound in ((IFNAME, host.netns, True), (host.veth, None, False)):
                cmds = tc_commands(dev, impairment, outbound=outbound)
                if cmds:
                    self._tc_on.add((dev, netns))
                for cmd in cmds:
                    _tc(cmd, netns)
            if impairment.delays:
                self._start_delay_line(host, impairment)
        except BaseException:
            self.heal(name)
            raise

    def heal(self, name: str) -> None:
        """Take every impairment off `name`'s link (idempotent)."""
        host = self.hosts[name]
        errors = []
        line = self._delay_lines.pop(name, None)
        if line is not None:
            errors += self._stop_delay_line(line)
        for dev, netns in ((IFNAME, host.netns), (host.veth, None)):
            if (dev, netns) in self._tc_on:
                try:
                    _tc(tc_clear(dev), netns)
                except RuntimeError as err:
                    errors.append(str(err))
                self._tc_on.discard((dev, netns))
        self.impairments.pop(name, None)
        if errors:
            raise RuntimeError("; ".join(errors))

    def heal_all(self) -> None:
        errors = []
        for name in list(self.impairments) + list(self._delay_lines):
            try:
                self.heal(name)
            except RuntimeError as err:
                errors.append(str(err))
        if errors:
            raise RuntimeError("; ".join(errors))

    def _start_delay_line(self, host: Host, imp: Impairment) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "trainyard_core.testing.delayline", "--port", host.veth,
                                 "--tap", host.tap, "--delay-ms", f"{imp.delay_ms:g}", "--jitter-ms",
                                 f"{imp.jitter_ms:g}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        self._delay_lines[host.name] = _DelayLine(proc, host.veth)
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()  # "ready", or "" when it failed to start
        if first != "ready":
            proc.wait(DELAY_LINE_READY_S)
            raise RuntimeError(f"the delay line for {host.name} did not start: {proc.stderr.read().strip()}"
                               if proc.stderr else "the delay line did not start")
        # The tap joins the bridge before the veth leaves it: frames have a path all along (a few may pass
        # twice for an instant, which TCP ignores); the other way round the host is cut off for a moment.
        _ip("link", "set", host.tap, "master", self.bridge, "up")
        _ip("link", "set", host.veth, "nomaster")

    def _stop_delay_line(self, line: _DelayLine) -> list[str]:
        errors = []
        try:
            _ip("link", "set", line.veth, "master", self.bridge)
        except RuntimeError as err:
            errors.append(str(err))
        if line.proc.poll() is None:
            line.proc.terminate()
            try:
                line.proc.wait(5)
            except subprocess.TimeoutExpired:
                line.proc.kill()
                line.proc.wait()
        for stream in (line.proc.stdout, line.proc.stderr):
            if stream is not None:
                stream.close()
        return errors

    # -- teardown ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove what this object created; idempotent. Deleting a namespace destroys its veth pair."""
        errors = []
        for line in self._delay_lines.values():
            errors += self._stop_delay_line(line)
        self._delay_lines.clear()
        for dev, netns in list(self._tc_on):
            if netns is None:   # those inside namespaces go with them
                with contextlib.suppress(RuntimeError):
                    _tc(tc_clear(dev))
        self._tc_on.clear()
        self.impairments.clear()
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
        self.root_addresses.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> HostNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()
