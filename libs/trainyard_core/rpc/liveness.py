"""The transport half of node liveness: HTTP/2 keepalive on the agent ↔ scheduler heartbeat stream.

A node is alive while its heartbeat stream to the scheduler leader is open (docs/architecture.md, "Node
liveness"). What keeps that true is not messages but HTTP/2 PING frames, answered by gRPC's C core on both
ends without any Python running:

- the scheduler's server pings every agent connection every `KEEPALIVE_INTERVAL_S` and closes one whose peer
  has not answered within `KEEPALIVE_TIMEOUT_S` (a dead host, a cut cable, a frozen agent process), which ends
  the stream and is the scheduler's evidence of a loss;
- the agent's channel pings the scheduler the same way, so an agent notices a dead or unreachable leader as
  fast, stops renewing its worker fence and looks for the next replica.

One place for these numbers because both ends and the worker-fence arithmetic depend on them.
"""

from __future__ import annotations

from collections.abc import Sequence

KEEPALIVE_INTERVAL_S = 1.0
KEEPALIVE_TIMEOUT_S = 1.0
# The longest a peer that stopped answering can still look connected to the other end.
TRANSPORT_DETECT_S = KEEPALIVE_INTERVAL_S + KEEPALIVE_TIMEOUT_S
# An agent renews its worker lease this often while its stream to the leader is open. A lost node's workers
# can thus outlive the leader's last proof of life by up to the lease plus TRANSPORT_DETECT_S plus this.
LEASE_RENEW_S = 0.25

Options = Sequence[tuple[str, int | str]]

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", int(KEEPALIVE_INTERVAL_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    # Without this, a side that sends no data stops pinging after two pings.
    ("grpc.http2.max_pings_without_data", 0),
    # How long an unanswered ping may wait before the transport is closed (the C core takes this, not only
    # keepalive_timeout_ms, for keepalive pings: its default is a minute).
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
]

# The scheduler's server: ping every agent, and take the agents' pings (at their interval) without calling
# them abusive (by default a server sends GOAWAY to a client pinging more often than every 5 minutes).
SERVER_OPTIONS: Options = [
    *_KEEPALIVE,
    ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_INTERVAL_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),
]

# The agent's channel to the scheduler.
CHANNEL_OPTIONS: Options = list(_KEEPALIVE)


def merged(base: Options, override: Options) -> list[tuple[str, int | str]]:
    """`base` with every option `override` names replaced by its value there (gRPC would otherwise see both)."""
    names = {k for k, _ in override}
    return [*((k, v) for k, v in base if k not in names), *override]
