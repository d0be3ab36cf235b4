"""A delay line: a user-space wire between one network device and a tap device it creates, that carries every
frame both ways after a delay with jitter. `netns.HostNetwork.impair` starts it for a host's latency (this
kernel has no netem): the host's veth peer leaves the bridge and the tap joins it in its place.

    python -m trainyard_core.testing.delayline --port tyv-abcd-0 --tap tyt-abcd-0 --delay-ms 120 --jitter-ms 20

- Frames are read from `--port` with an AF_PACKET socket (frames the host sent; the copies of what this
  program sends out there are ignored) and written to the tap (they appear on the bridge as if the host sent
  them there), and read from the tap (what the bridge sends towards the host) and sent out of `--port`.
- Both ends carry the virtio-net header (PACKET_VNET_HDR, IFF_VNET_HDR), so offloaded frames (checksum not
  filled in, one GSO frame for many segments, as veth devices hand them over) pass through unchanged and the
  kernel finishes them on the other side.
- Each frame leaves `delay ± jitter` (uniform) after it arrived, and never before the frame ahead of it in
  its direction: jitter changes the spacing, not the order (reordering would make TCP retransmit and turn a
  bounded delay into unbounded stalls).
- It prints `ready` once both ends are open, and stops on SIGTERM or SIGINT. The tap is not persistent: it
  disappears when this process exits, however it exits.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
ETH_P_ALL = 0x0003
MAX_FRAME = 65536 + 64   # a GSO frame and its virtio-net header
MAX_QUEUED = 20000       # frames per direction; beyond that a frame is dropped, as a full link queue drops it


class DelayLine:
    def __init__(self, port: str, tap: str, delay_s: float, jitter_s: float, rng: random.Random) -> None:
        self.delay_s, self.jitter_s, self.rng = delay_s, jitter_s, rng
        self.tap_fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(self.tap_fd, TUNSETIFF, struct.pack("16sH", tap.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        try:
            self.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        except OSError:  # older kernels: the pkttype check below does the same
            pass
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((port, ETH_P_ALL))
        os.set_blocking(self.tap_fd, False)
        self.sock.setblocking(False)
        # direction → frames waiting, each (departure time, bytes); departure times never decrease.
        self.to_tap: collections.deque[tuple[float, bytes]] = collections.deque()
        self.to_port: collections.deque[tuple[float, bytes]] = collections.deque()
        self.carried = 0
        self.dropped = 0

    def _departure(self, queue: collections.deque[tuple[float, bytes]], now: float) -> float:
        at = now + self.delay_s + self.rng.uniform(-self.jitter_s, self.jitter_s)
        return max(at, queue[-1][0]) if queue else at

    def _take(self, queue: collections.deque[tuple[float, bytes]], frame: bytes, now: float) -> None:
        if len(queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        queue.append((self._departure(queue, now), frame))

    def _read_port(self, now: float) -> None:
        while True:
            try:
                frame, addr = self.sock.recvfrom(MAX_FRAME)
            except BlockingIOError:
                return
            if addr[2] != PACKET_OUTGOING:
                self._take(self.to_tap, frame, now)

    def _read_tap(self, now: float) -> None:
        while True:
            try:
                frame = os.read(self.tap_fd, MAX_FRAME)
            except BlockingIOError:
                return
            self._take(self.to_port, frame, now)

    def _send_due(self, now: float) -> None:
        while self.to_tap and self.to_tap[0][0] <= now:
            self._send(lambda f: os.write(self.tap_fd, f), self.to_tap.popleft()[1])
        while self.to_port and self.to_port[0][0] <= now:
            self._send(self.sock.send, self.to_port.popleft()[1])

    def _send(self, write: Callable[[bytes], object], frame: bytes) -> None:
        try:
            write(frame)
            self.carried += 1
        except OSError:  # a full device queue, a frame the device refuses: lost, as on a real link
            self.dropped += 1

    def run(self, stop: list[bool]) -> None:
        while not stop[0]:
            heads = [q[0][0] for q in (self.to_tap, self.to_port) if q]
            timeout = max(0.0, min(heads) - time.monotonic()) if heads else 0.5
            try:
                ready, _, _ = select.select([self.tap_fd, self.sock.fileno()], [], [], timeout)
            except InterruptedError:
                continue
            now = time.monotonic()
            if self.sock.fileno() in ready:
                self._read_port(now)
            if self.tap_fd in ready:
                self._read_tap(now)
            self._send_due(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--port", required=True, help="the device whose traffic is delayed (a host's veth peer)")
    p.add_argument("--tap", required=True, help="name of the tap device to create (it takes the port's place)")
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seed of the jitter draws")
    args = p.parse_args(argv)
    if args.delay_ms < 0 or not 0 <= args.jitter_ms <= args.delay_ms:
        p.error("--delay-ms must be >= 0 and --jitter-ms within 0..delay")
    stop = [False]

    def on_signal(signum: int, frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    line = DelayLine(args.port, args.tap, args.delay_ms / 1000, args.jitter_ms / 1000, random.Random(args.seed))
    print("ready", flush=True)
    line.run(stop)
    print(f"carried {line.carried} frames, dropped {line.dropped}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
