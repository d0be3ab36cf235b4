"""`async_save`: the trainer blocks only while its tensors are copied to shared memory; a separate saver
process (one per rank, started on first use) writes, checksums and commits the checkpoint.

Why a process and not a thread: writing and checksumming gigabytes holds the GIL often enough to slow a
Python training loop; in its own process it only competes for memory bandwidth. The saver is started
with `python -m trainyard_checkpoint.client._saver` (not multiprocessing's spawn, which would re-import
the training script's `__main__`), talks to the trainer over a socket pair, dies with the trainer
(PR_SET_PDEATHSIG), and has its own gloo process group with the other ranks' savers, rendezvousing on a
TCPStore that rank 0's trainer hosts. Savers run exactly the same `save_collective` as `save`.

Life of one async save, on every rank:

    async_save: wait for the previous save (one in flight) ─▶ [all ranks agree whether savers must be
    (re)started: a tiny all-reduce] ─▶ stage into the arena ─▶ send the skeleton ─▶ return a SaveHandle
    saver:      Begin (rank 0) ─▶ DCP save ─▶ Commit (rank 0) ─▶ reply ─▶ handle.result() returns

A saver whose save failed, or that died, is replaced on every rank before the next async save (the
all-reduce makes that decision the same on every rank, so the savers' process groups always match).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import TCPStore

from . import ipc
from .env import ClientSettings
from .errors import CheckpointError
from .gang import Gang
from .service import CheckpointInfo
from .staging import Stager

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaverConfig:
    settings: ClientSettings
    rank: int
    world_size: int
    distributed: bool
    store_host: str
    store_port: int
    store_prefix: str
    parent_pid: int
    log_level: int


@dataclass(frozen=True, slots=True)
class SaveRequest:
    step: int
    metadata: dict[str, str]
    skeleton: dict[str, Any]
    arena_bytes: int
    arena_generation: int
    attach_arena: bool


class SaveHandle:
    """An async save in flight. `result()` waits and returns the committed checkpoint (or raises
    CheckpointError). Timings, in seconds: `blocking_s` is how long `async_save` held the caller, made of
    `waited_s` (for the previous save to finish) and `staging_s` (the copy to shared memory); `total_s`
    is from the call until the checkpoint was committed (None until done)."""

    def __init__(self, step: int, started: float) -> None:
        self.step = step
        self.waited_s = 0.0
        self.staging_s = 0.0
        self.blocking_s = 0.0
        self.total_s: float | None = None
        self.saver_pid = 0
        self._started = started
        self._future: Future[CheckpointInfo] = Future()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the save finished either way; False on timeout. Never raises the save's error."""
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            return False
        return True

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"the async save of step {self.step} did not finish within {timeout}s") from None

    def _resolve(self, outcome: CheckpointInfo | CheckpointError) -> None:
        self.total_s = time.perf_counter() - self._started
        if isinstance(outcome, CheckpointError):
            self._future.set_exception(outcome)
        else:
            self._future.set_result(outcome)


def _import_roots() -> list[str]:
    """Directories the saver needs on its path to import this package, trainyard_core and the
    generated gRPC code, wherever they come from (an install or a source checkout)."""
    import trainyard_checkpoint
    import trainyard_core
    from trainyard.checkpoint.v1 import checkpoint_pb2

    roots = [Path(trainyard_checkpoint.__file__ or "").resolve().parents[1],
             Path(trainyard_core.__file__ or "").resolve().parents[1],
             Path(checkpoint_pb2.__file__ or "").resolve().parents[3]]
    return list(dict.fromkeys(str(r) for r in roots))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class AsyncSaver:
    """The trainer's side of async saves for one client. Methods are called from the training thread."""

    def __init__(self, settings: ClientSettings, gang: Gang) -> None:
        self._settings = settings
        self._gang = gang
        self._stager = Stager()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._failed = False
        self._arena_sent = 0
        self._inflight: SaveHandle | None = None
        self._store: Any = None  # rank 0's TCPStore for the savers' rendezvous
        self._rendezvous: tuple[str, int, str] | None = None
        self._generation = 0
        self._starts = 0
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # A script that ends without close() still gets its last checkpoint (see _at_exit).
        atexit.register(self._at_exit)

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.wait()

    def _rendezvous_point(self) -> tuple[str, int, str]:
        if self._rendezvous is None:
            offer = None
            if self._gang.rank == 0:
                self._store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
                host = os.environ.get("MASTER_ADDR") or socket.getfqdn()
                offer = (host, int(self._store.port), uuid.uuid4().hex)
            self._rendezvous = self._gang.broadcast(offer)
        if self._rendezvous is None:
            raise CheckpointError("rank 0 offered no rendezvous point for the saver processes")
        return self._rendezvous

    def _stop_saver(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            _kill(self._proc)
            self._proc = None

    def _start_saver(self) -> None:
        self._stop_saver()
        host, port, prefix = "", 0, ""
        if self._gang.distributed:
            host, port, token = self._rendezvous_point()
            self._generation += 1
            prefix = f"trainyard-checkpoint-saver/{token}/{self._generation}/"
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*_import_roots(), *filter(None, [env.get("PYTHONPATH")])])
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "trainyard_checkpoint.client._saver", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        self._sock = ours
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        self._starts += 1
        # The crash-test hook (faults.py) kills the first saver only: it stands for one crash, after which
        # the replacement must work.
        settings = self._settings if self._starts == 1 else dataclasses.replace(self._settings, kill=None)
        ipc.send(ours, SaverConfig(settings=settings, rank=self._gang.rank, world_size=self._gang.world_size,
                                   distributed=self._gang.distributed, store_host=host, store_port=port,
                                   store_prefix=prefix, parent_pid=os.getpid(),
                                   log_level=logging.getLogger().getEffectiveLevel()))
        self._arena_sent = 0
        self._failed = False

    def submit(self, state_dict: Mapping[str, Any], step: int, metadata: Mapping[str, str] | None) -> SaveHandle:
        started = time.perf_counter()
        handle = SaveHandle(step, started)
        if self._inflight is not None:
            self._inflight.wait()
        waited = time.perf_counter()
        dead = self._proc is None or self._proc.poll() is not None
        restart = self._gang.any(dead or self._failed)
        staging_start = time.perf_counter()
        skeleton, _new = self._stager.stage(state_dict)
        handle.staging_s = time.perf_counter() - staging_start
        if restart:  # after staging: a new saver's start-up would compete with the copy for the CPU
            self._start_saver()
        arena = self._stager.arena
        if arena is None or self._sock is None or self._proc is None:
            raise CheckpointError("the saver process was not started")
        attach = self._arena_sent != arena.generation
        request = SaveRequest(step=step, metadata=dict(metadata or {}), skeleton=skeleton,
                              arena_bytes=arena.nbytes, arena_generation=arena.generation, attach_arena=attach)
        handle.waited_s = waited - started
        try:
            ipc.send(self._sock, request, [arena.fd] if attach else [])
        except OSError as e:
            self._failed = True
            handle._resolve(CheckpointError(f"the checkpoint saver process is gone ({e}); the next async save "
                                            "starts a new one"))
        else:
            self._arena_sent = arena.generation
            handle.saver_pid = self._proc.pid
            threading.Thread(target=self._await_reply, args=(handle, self._sock, self._proc),
                             name=f"trainyard-checkpoint-save-{step}", daemon=True).start()
        handle.blocking_s = time.perf_counter() - started
        self._inflight = handle
        return handle

    def _await_reply(self, handle: SaveHandle, sock: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        outcome: CheckpointInfo | CheckpointError
        try:
            (kind, payload), _ = ipc.recv(sock)
            outcome = payload
            if not isinstance(outcome, CheckpointInfo | CheckpointError):
                outcome = CheckpointError(f"the saver answered {kind!r} with {type(payload).__name__}")
        except (EOFError, OSError):
            code = proc.wait()
            outcome = CheckpointError(f"the checkpoint saver process died (exit code {code}) while saving step "
                                      f"{handle.step}; the next async save starts a new one")
        if isinstance(outcome, CheckpointError):
            self._failed = True
        handle._resolve(outcome)

    def _at_exit(self) -> None:
        handle = self._inflight
        if handle is not None and not handle.done():
            limit = self._settings.rpc_timeout_s
            log.warning("waiting up to %.0fs for the async save of step %d before exiting (call "
                        "CheckpointClient.close() to wait explicitly)", limit, handle.step)
            handle.wait(limit)
        self._stop_saver()

    def close(self) -> None:
        """Wait for the save in flight, then stop the saver."""
        atexit.unregister(self._at_exit)
        self.wait()
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            try:
                ipc.send(self._sock, None)
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._stop_saver()
        self._stager.close()
        self._store = None
