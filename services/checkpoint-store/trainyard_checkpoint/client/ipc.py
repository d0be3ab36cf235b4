"""Messages between the trainer and its saver process over a Unix socket pair: a length-prefixed pickle,
optionally with file descriptors (the staging arena) passed alongside."""

from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import Sequence
from typing import Any

_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(payload))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _exactly(sock: socket.socket, n: int, have: bytes = b"") -> bytes:
    parts = [have]
    got = len(have)
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the descriptors that came with it. EOFError when the peer is gone."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 4)
    if not head:
        raise EOFError("the peer closed the connection")
    (length,) = _HEADER.unpack(_exactly(sock, _HEADER.size, head))
    return pickle.loads(_exactly(sock, length)), list(fds)
