"""The saver process of async saves (see async_save.py): `python -m trainyard_checkpoint.client._saver FD`.

It reads its configuration, then save requests, from the socket FD; joins the other ranks' savers in a
gloo process group; and answers each request with ("ok", CheckpointInfo) or ("error", CheckpointError).
It exits when the trainer says so, when the socket closes, or (PR_SET_PDEATHSIG) when the trainer dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from . import ipc
from .async_save import SaverConfig, SaveRequest
from .errors import CheckpointError
from .faults import KillPoints
from .gang import Gang
from .saving import save_collective
from .service import ServiceClient
from .staging import Materializer

log = logging.getLogger("trainyard_checkpoint.client.saver")
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed socket still ends the loop
        return
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        os._exit(1)


def _reply(sock: socket.socket, kind: str, payload: object) -> None:
    try:
        pickle.dumps(payload)
    except Exception:
        payload = CheckpointError(str(payload))
    ipc.send(sock, (kind, payload))


def serve(sock: socket.socket) -> None:
    config, _ = ipc.recv(sock)
    if not isinstance(config, SaverConfig):
        raise SystemExit(f"expected a SaverConfig, got {type(config).__name__}")
    _die_with_parent(config.parent_pid)
    logging.basicConfig(level=config.log_level, format=f"%(asctime)s saver[rank {config.rank}] %(levelname)s "
                                                        "%(name)s: %(message)s")
    settings = config.settings
    if config.distributed:
        timeout = timedelta(seconds=settings.collective_timeout_s)
        store = TCPStore(config.store_host, config.store_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=PrefixStore(config.store_prefix, store), rank=config.rank,
                                world_size=config.world_size, timeout=timeout)
    gang = Gang(None)
    points = KillPoints(settings.kill, config.rank)
    service: list[ServiceClient] = []

    def service_client() -> ServiceClient:
        if not service:
            service.append(ServiceClient.for_settings(settings))
        return service[0]

    materializer = Materializer()
    try:
        while True:
            try:
                request, fds = ipc.recv(sock)
            except EOFError:
                return
            if request is None:
                return
            if not isinstance(request, SaveRequest):
                raise SystemExit(f"expected a SaveRequest, got {type(request).__name__}")
            if request.attach_arena:
                if not fds:
                    _reply(sock, "error", CheckpointError("the staging arena did not arrive with the request"))
                    continue
                materializer.attach(fds[0], request.arena_bytes, request.arena_generation)
            state_dict = None
            try:
                state_dict = materializer.build(request.skeleton)
                info = save_collective(state_dict, request.step, gang=gang, settings=settings,
                                       service=service_client, points=points, metadata=request.metadata)
            except CheckpointError as e:
                _reply(sock, "error", e)
            except Exception as e:
                log.exception("async save of step %d failed", request.step)
                _reply(sock, "error", CheckpointError(f"async save of step {request.step} failed in the saver "
                                                      f"(rank {config.rank}): {type(e).__name__}: {e}"))
            else:
                _reply(sock, "ok", info)
            state_dict = None  # drop the views of the arena before it may be replaced
    finally:
        if service:
            service[0].close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m trainyard_checkpoint.client._saver FD", file=sys.stderr)
        return 2
    with socket.socket(fileno=int(argv[1])) as sock:
        serve(sock)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
