"""The transport half of node liveness: HTTP/2 keepalive and idle limits on the agent ↔ scheduler connections.

A node is proved alive by its liveness pulses (`pulse.py`, docs/architecture.md "Node liveness"), not by its
connection, so keepalive here is for the connections themselves and runs at rates a leader of 10,000 nodes
can afford (gRPC's C core answers the pings; each costs the server a read and a write on a TLS connection):

- the agent's channel pings the leader every `AGENT_KEEPALIVE_S` and gives up after `KEEPALIVE_TIMEOUT_S`,
  only to close a connection that died without a FIN; an agent notices a silent leader sooner, when its
  pulses go unacknowledged for `pulse.RECONNECT_AFTER_S`, and its worker lease stops being renewed sooner
  still (`pulse.ACK_WINDOW_S`);
- the scheduler's server pings every connection every `SERVER_KEEPALIVE_S`, only to close the connections
  of agents that vanished without a FIN (a dead host), so their streams and pulse sessions do not linger.

Measured here (bench/_keepalive.py's bare server, 400 mTLS connections, server CPU per connection-second):
idle connections without pings 20 µs; server pings every 30 s +2.5 µs; agent pings every 4 s +57 µs (each
answered ping costs the server ~230 µs in gRPC's C core); pulses every 0.5 s +77 µs. Hence pings every five
minutes each way: they only clear connections whose peer vanished, which pulses already noticed (a leader of
5,000 nodes answered ~170 pings a second at one a minute each way, a few percent of its core). The stream
carries a refresh beat every heartbeat interval anyway, so no middlebox sees it idle.

One place for these numbers because both ends depend on them.
"""

from __future__ import annotations

from collections.abc import Sequence

AGENT_KEEPALIVE_S = 300.0
KEEPALIVE_TIMEOUT_S = 10.0
# The longest a connection whose peer vanished can still look open to the agent.
TRANSPORT_DETECT_S = AGENT_KEEPALIVE_S + KEEPALIVE_TIMEOUT_S
SERVER_KEEPALIVE_S = 300.0
SERVER_KEEPALIVE_TIMEOUT_S = 10.0
# An agent renews its worker lease this often while the leader acknowledges its pulses. A lost node's
# workers can thus outlive the leader's last proof of life by up to the lease plus pulse.ACK_WINDOW_S plus
# this.
LEASE_RENEW_S = 0.25
# Connections between an agent and the leader are not held (the connectionless path, docs/architecture.md
# "Node liveness"): each costs the leader ~96 KB of gRPC C core and BoringSSL memory while open (1 GB at
# 10,000 agents), and the pulses, not a connection, prove a node alive. The agent's channel drops its
# connection once no call has been made on it for AGENT_IDLE_S (a beat, a worker exit: changes come in bursts,
# which then share one handshake), and the scheduler's channels to the agents (launch, stop) do the same after
# LAUNCH_IDLE_S. The scheduler's server ends a connection without calls after SERVER_IDLE_S (GOAWAY: the
# client reconnects on its next call), which also frees what a peer that does not drop its own holds.
AGENT_IDLE_S = 15.0
LAUNCH_IDLE_S = 60.0
SERVER_IDLE_S = 120.0

Options = Sequence[tuple[str, int | str]]

def _keepalive(interval_s: float, timeout_s: float) -> list[tuple[str, int | str]]:
    return [
        ("grpc.keepalive_time_ms", int(interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Without this, a side that sends no data stops pinging after two pings.
        ("grpc.http2.max_pings_without_data", 0),
        # How long an unanswered ping may wait before the transport is closed (the C core takes this, not only
        # keepalive_timeout_ms, for keepalive pings: its default is a minute).
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
    ]


# The scheduler's server: ping every connection now and then, and take the agents' pings (at their interval)
# without calling them abusive (by default a server sends GOAWAY to a client pinging more often than every
# 5 minutes).
SERVER_OPTIONS: Options = [
    *_keepalive(SERVER_KEEPALIVE_S, SERVER_KEEPALIVE_TIMEOUT_S),
    ("grpc.http2.min_ping_interval_without_data_ms", int(AGENT_KEEPALIVE_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_connection_idle_ms", int(SERVER_IDLE_S * 1000)),
]

# The agent's channel to the scheduler.
CHANNEL_OPTIONS: Options = [*_keepalive(AGENT_KEEPALIVE_S, KEEPALIVE_TIMEOUT_S),
                            ("grpc.client_idle_timeout_ms", int(AGENT_IDLE_S * 1000))]
# Added to the scheduler's pool of channels to the agents.
LAUNCH_CHANNEL_OPTIONS: Options = [("grpc.client_idle_timeout_ms", int(LAUNCH_IDLE_S * 1000))]


def merged(base: Options, override: Options) -> list[tuple[str, int | str]]:
    """`base` with every option `override` names replaced by its value there (gRPC would otherwise see both)."""
    names = {k for k, _ in override}
    return [*((k, v) for k, v in base if k not in names), *override]
