"""The network faults the chaos suite draws, on a real HostNetwork (root only; skipped elsewhere with the
reason): a cut drops one peer both ways and nothing else, an isolated host reaches nobody, loss drops the
fraction it says, latency holds every frame back at least the delay without breaking a connection, and each
heals back to a working link. The pure parts (validation, the tc command lines) run everywhere."""

from __future__ import annotations

import functools
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from trainyard_core.testing import netns
from trainyard_core.testing.linkfaults import Impairment, Peer, loss_bytecode, tc_commands
from trainyard_core.testing.netns import HostNetwork
from trainyard_core.testing.wait import until

needs_root = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

ECHO = """
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
def serve(c):
    with c:
        while (d := c.recv(65536)):
            c.sendall(d)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""
# Prints "ok" when a TCP connection to argv[1]:argv[2] echoes a byte within argv[3] seconds, else "no".
REACH = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        s.sendall(b"x"); print("ok" if s.recv(1) == b"x" else "no")
except OSError:
    print("no")
"""
UDP_BURST = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2])))
"""
PORT, OTHER_PORT = 7101, 7102


# -- pure ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_pct": 101.0}, "loss_pct"), ({"loss_pct": -1.0}, "loss_pct"),
    ({"delay_ms": 50.0, "jitter_ms": 60.0}, "jitter"), ({"delay_ms": 350.0, "jitter_ms": 100.0}, "round trip"),
    ({"delay_ms": -5.0}, "delay_ms")])
def test_an_impairment_out_of_range_is_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Impairment(**kwargs)


def test_a_peer_must_be_an_address_and_a_port() -> None:
    with pytest.raises(ValueError):
        Peer("scheduler-1")
    with pytest.raises(ValueError, match="port"):
        Peer("10.0.0.1", 70000)


def test_a_cut_matches_the_peer_as_destination_outbound_and_as_source_inbound() -> None:
    imp = Impairment(cut=(Peer("10.231.7.11"), Peer("10.231.7.12", 5000)))
    out = [" ".join(c) for c in tc_commands("eth0", imp, outbound=True)]
    inbound = [" ".join(c) for c in tc_commands("tyv-x-0", imp, outbound=False)]
    assert any("match ip dst 10.231.7.11/32 flowid 1:99" in c for c in out), out
    assert any("match ip dst 10.231.7.12/32 match ip dport 5000 0xffff flowid 1:99" in c for c in out), out
    assert any("match ip src 10.231.7.12/32 match ip sport 5000 0xffff flowid 1:99" in c for c in inbound), inbound
    assert any("pfifo limit 0" in c for c in out) and not any("dst" in c for c in inbound)
    assert tc_commands("eth0", Impairment(delay_ms=100.0), outbound=True) == []


def test_the_loss_filter_matches_above_the_threshold_of_the_random_word() -> None:
    assert loss_bytecode(25.0).split(",")[2] == f"53 0 1 {round(0.75 * 2**32)}"
    assert loss_bytecode(100.0).split(",")[2] == "53 0 1 0"


# -- on a real network -----------------------------------------------------------------------------------
@pytest.fixture
def net() -> Iterator[HostNetwork]:
    network = HostNetwork(["a", "b"], root_addresses=1).create()
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for host, port in (("a", PORT), ("b", PORT), ("b", OTHER_PORT)):
            servers.append(subprocess.Popen([*network.exec_prefix(host), sys.executable, "-c", ECHO,
                                             network.hosts[host].address, str(port)]))
        servers.append(subprocess.Popen([sys.executable, "-c", ECHO, network.root_addresses[0], str(PORT)]))
        for address, port in ((network.hosts["a"].address, PORT), (network.hosts["b"].address, PORT),
                              (network.hosts["b"].address, OTHER_PORT), (network.root_addresses[0], PORT)):
            until(functools.partial(_reachable_from_root, address, port), 20, f"echo server on {address}:{port}")
        yield network
    finally:
        for p in servers:
            p.kill()
            p.wait()
        network.close()


def _reachable_from_root(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


def reach(net: HostNetwork, src: str, address: str, port: int = PORT, timeout: float = 1.5) -> bool:
    return net.run_in(src, sys.executable, "-c", REACH, address, str(port), str(timeout)).stdout.strip() == "ok"


@needs_root
def test_a_cut_drops_one_peer_both_ways_and_nothing_else_until_healed(net: HostNetwork) -> None:
    a, b, root = net.hosts["a"].address, net.hosts["b"].address, net.root_addresses[0]
    assert reach(net, "a", b) and reach(net, "b", a)
    net.impair("a", Impairment(cut=(Peer(b),)))
    assert not reach(net, "a", b) and not reach(net, "b", a)
    assert reach(net, "a", root)
    net.heal("a")
    assert reach(net, "a", b) and reach(net, "b", a)
    # One port of the peer only: the other port of the same host still answers.
    net.impair("a", Impairment(cut=(Peer(b, PORT),)))
    assert not reach(net, "a", b, PORT) and reach(net, "a", b, OTHER_PORT)
    net.heal("a")
    assert reach(net, "a", b, PORT)


@needs_root
def test_an_isolated_host_reaches_nobody_and_nobody_reaches_it(net: HostNetwork) -> None:
    a, b, root = net.hosts["a"].address, net.hosts["b"].address, net.root_addresses[0]
    net.impair("a", Impairment(isolated=True))
    assert not reach(net, "a", b) and not reach(net, "a", root) and not reach(net, "b", a)
    assert not _reachable_from_root(a, PORT)
    assert reach(net, "b", root)
    net.heal("a")
    assert reach(net, "a", b) and reach(net, "a", root) and _reachable_from_root(a, PORT)


def _dropped(net: HostNetwork, host: str) -> int:
    out = net.run_in(host, "tc", "-s", "qdisc", "show", "dev", "eth0").stdout
    found = re.search(r"qdisc pfifo 99:.*?dropped (\d+)", out, re.S)
    assert found, out
    return int(found.group(1))


@needs_root
def test_loss_drops_the_fraction_it_says(net: HostNetwork) -> None:
    root, sent = net.root_addresses[0], 4000
    net.impair("a", Impairment(loss_pct=25.0))
    net.run_in("a", sys.executable, "-c", UDP_BURST, root, "9", str(sent))
    # 4000 draws at p = 0.25: the standard deviation is 27 packets, the bounds are 7 of them away.
    assert 800 <= _dropped(net, "a") <= 1200
    net.impair("a", Impairment(loss_pct=100.0))
    net.run_in("a", sys.executable, "-c", UDP_BURST, root, "9", "100")
    # Every one of the burst, and at most a few frames the host sent on its own meanwhile (ARP, IPv6
    # neighbour discovery) that the same filter dropped.
    assert 100 <= _dropped(net, "a") <= 110
    assert not reach(net, "a", root)
    net.heal("a")
    assert reach(net, "a", root)


RTTS = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
out = []
for i in range(int(sys.argv[3])):
    t = time.monotonic(); s.sendall(b"%d;" % i); got = b""
    while not got.endswith(b";"):
        got += s.recv(64)
    assert got == b"%d;" % i, got
    out.append(time.monotonic() - t)
print(min(out))
"""


@needs_root
def test_latency_holds_every_frame_back_and_a_connection_lives_through_it(net: HostNetwork) -> None:
    b = net.hosts["b"]
    # A connection opened before the fault carries on through it and after the heal.
    with socket.create_connection((b.address, PORT), timeout=10) as conn:
        conn.sendall(b"before")
        assert conn.recv(16) == b"before"
        net.impair("b", Impairment(delay_ms=150.0, jitter_ms=30.0))
        link = subprocess.run(["ip", "-o", "link", "show", b.veth], capture_output=True, text=True, check=True)
        assert f"master {net.bridge}" not in link.stdout
        # Each way at least delay - jitter: a round trip is never under 240 ms (from b's host, and from root).
        slowest_fast = float(net.run_in("a", sys.executable, "-c", RTTS, b.address, str(PORT), "5").stdout)
        assert slowest_fast >= 0.24, slowest_fast
        conn.sendall(b"during")
        assert conn.recv(16) == b"during"
        net.heal("b")
        conn.sendall(b"after")
        assert conn.recv(16) == b"after"
    link = subprocess.run(["ip", "-o", "link", "show", b.veth], capture_output=True, text=True, check=True)
    assert f"master {net.bridge}" in link.stdout
    assert subprocess.run(["ip", "link", "show", b.tap], capture_output=True, check=False).returncode != 0


@needs_root
def test_close_removes_namespaces_bridge_delay_lines_and_taps() -> None:
    network = HostNetwork(["a"]).create()
    host = network.hosts["a"]
    network.impair("a", Impairment(delay_ms=20.0, loss_pct=5.0))
    [line] = network._delay_lines.values()
    network.close()
    assert line.proc.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert host.netns not in listed
    assert network.bridge not in links and host.tap not in links and host.veth not in links
