"""Staging for async saves: a snapshot of the state dict's tensors in memory shared with the saver process.

The trainer copies every tensor into one arena (an anonymous memfd, mapped by both processes; registered
as pinned memory when CUDA is in use so device-to-host copies run at full speed) and sends the saver a
*skeleton*: the state dict with each tensor replaced by its place in the arena. Everything else in the
state dict (ints, strings, BytesIO) travels in the pickled skeleton, which is also a snapshot.

The arena is reused from save to save (no allocation or page faults after the first) and grows when the
state does; the trainer only stages after the previous save finished, so the saver never sees a
half-overwritten arena.

The copy is the whole of what async_save blocks on, and it is bound by memory bandwidth, which one core
cannot use up: dense CPU tensors are copied by this stager's own threads (`memmove`, which releases the
GIL; torch's intra-op threads are often 1, as torchrun sets OMP_NUM_THREADS), the bytes split evenly
between them in as few and as long runs as possible (a copy longer than glibc's non-temporal threshold,
about 3/4 of the last-level cache, is streamed past the cache instead of reading each destination line
first). Device tensors and anything else are copied by `Tensor.copy_`. Every copy has finished when
`stage` returns.

In the saver, each tensor is a `torch.frombuffer` view whose storage is exactly the tensor (DCP would copy a
view of a larger storage before writing it).

DTensors are staged as their local shard plus their mesh and placements, and rebuilt in the saver on a
CPU mesh over the saver's own process group (same ranks), so DCP plans them exactly as in the trainer.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .errors import CheckpointError

ALIGN = 64
# Copy threads: enough to use a socket's memory bandwidth, not so many that they only queue for it.
MAX_COPY_THREADS = 8
# Below this many bytes per thread, starting threads costs more than it saves.
MIN_BYTES_PER_THREAD = 16 << 20


def _cudart() -> Any:
    get: Callable[[], Any] = torch.cuda.cudart
    return get()


@dataclass(frozen=True, slots=True)
class TensorRef:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DTensorRef:
    local: TensorRef
    mesh_device: str
    mesh: list[Any]  # nested lists of ranks, as DeviceMesh.mesh.tolist()
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class Arena:
    """Shared memory for staged tensors. The trainer creates it; the saver attaches to its fd."""

    def __init__(self, fd: int, nbytes: int, *, generation: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.generation = generation
        self._mm = mmap.mmap(fd, nbytes)
        self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False

    @classmethod
    def create(cls, nbytes: int, generation: int) -> Arena:
        fd = os.memfd_create("trainyard-checkpoint-staging", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        return cls(fd, nbytes, generation=generation)

    def pin(self) -> None:
        """Page-lock the arena for the CUDA driver (fast, asynchronous device-to-host copies)."""
        if self.pinned or not torch.cuda.is_available():
            return
        err = _cudart().cudaHostRegister(self.bytes.data_ptr(), self.nbytes, 0)
        self.pinned = int(err) == 0

    def view(self, ref: TensorRef) -> torch.Tensor:
        """A writable view of the arena for `ref` (the trainer's side)."""
        return self.bytes[ref.offset:ref.offset + ref.nbytes].view(ref.dtype).view(ref.shape)

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """A tensor whose storage is exactly `ref`'s bytes of the arena (the saver's side)."""
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=ref.dtype)
        itemsize = torch.empty((), dtype=ref.dtype).element_size()
        flat = torch.frombuffer(self._mm, dtype=ref.dtype, count=ref.nbytes // itemsize, offset=ref.offset)
        return flat.view(ref.shape)

    def close(self) -> None:
        if self.pinned:
            _cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it; the mapping goes when that tensor does
            pass
        os.close(self.fd)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def _raw_copyable(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes, as they lie in memory, are its value (so memmove may copy them)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


Run = tuple[int, int, int]  # (destination address, source address, bytes)


def split_runs(runs: list[Run], parts: int) -> list[list[Run]]:
    """`runs` cut into `parts` lists of (nearly) equal bytes, in order, each run cut at most where a
    part ends: the fewest and longest copies for `parts` threads."""
    total = sum(n for _, _, n in runs)
    share = -(-total // max(parts, 1))
    out: list[list[Run]] = [[]]
    room = share
    for dst, src, n in runs:
        done = 0
        while done < n:
            if room == 0:
                out.append([])
                room = share
            take = min(n - done, room)
            out[-1].append((dst + done, src + done, take))
            done += take
            room -= take
    return [part for part in out if part]


def _copy_runs(runs: list[Run]) -> None:
    for dst, src, n in runs:
        ctypes.memmove(dst, src, n)


class Stager:
    """Stages state dicts into an arena it owns. Not thread-safe (one save in flight at a time)."""

    def __init__(self, max_threads: int | None = None) -> None:
        self.arena: Arena | None = None
        self._generation = 0
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._max_threads = max(1, min(MAX_COPY_THREADS, cpus) if max_threads is None else max_threads)
        self._pool: ThreadPoolExecutor | None = None

    def _copy(self, arena: Arena, copies: list[tuple[TensorRef, torch.Tensor]]) -> None:
        base = arena.bytes.data_ptr()
        runs: list[Run] = []
        with torch.no_grad():
            for ref, src in copies:
                if not ref.nbytes:
                    continue
                if _raw_copyable(src):
                    runs.append((base + ref.offset, src.data_ptr(), ref.nbytes))
                else:
                    arena.view(ref).copy_(src, non_blocking=src.is_cuda and arena.pinned)
        total = sum(n for _, _, n in runs)
        parts = split_runs(runs, min(self._max_threads, max(1, total // MIN_BYTES_PER_THREAD)))
        if len(parts) <= 1:
            for part in parts:
                _copy_runs(part)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._max_threads - 1,
                                            thread_name_prefix="trainyard-checkpoint-stage")
        # `copies` holds every source tensor until all threads are done with it.
        pending = [self._pool.submit(_copy_runs, part) for part in parts[1:]]
        _copy_runs(parts[0])
        for done in pending:
            done.result()

    def _layout(self, obj: Any, copies: list[tuple[TensorRef, torch.Tensor]], used: list[int]) -> Any:
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            local = self._layout(obj.to_local(), copies, used)
            return DTensorRef(local=local, mesh_device=str(mesh.device_type), mesh=mesh.mesh.tolist(),
                              mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                              placements=tuple(obj.placements), shape=tuple(obj.shape),
                              stride=tuple(obj.stride()))
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise CheckpointError(f"async_save cannot stage a {type(obj).__name__}; use save() for it")
            if obj.is_sparse or obj.is_quantized or obj.is_meta:
                raise CheckpointError("async_save stages dense tensors only; use save() for sparse, quantized or "
                                      "meta tensors")
            ref = TensorRef(offset=used[0], nbytes=_nbytes(obj), dtype=obj.dtype, shape=tuple(obj.shape))
            used[0] += -(-ref.nbytes // ALIGN) * ALIGN
            copies.append((ref, obj.detach()))
            return ref
        if isinstance(obj, Mapping):
            return {k: self._layout(v, copies, used) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._layout(v, copies, used) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._layout(v, copies, used) for v in obj)
        return obj

    def stage(self, state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Copy every tensor into the arena; the skeleton and whether the arena is new (the saver must
        attach to it). Returns once every copy, device-to-host included, has completed."""
        flat = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}
        copies: list[tuple[TensorRef, torch.Tensor]] = []
        used = [0]
        skeleton = self._layout(flat, copies, used)
        new = False
        if self.arena is None or self.arena.nbytes < used[0]:
            if self.arena is not None:
                self.arena.close()
            self._generation += 1
            # Page-rounded, and never zero (mmap refuses an empty mapping).
            self.arena = Arena.create(max(mmap.PAGESIZE, -(-used[0] // mmap.PAGESIZE) * mmap.PAGESIZE),
                                      self._generation)
            new = True
        arena = self.arena
        on_device = any(src.is_cuda for _, src in copies)
        if on_device:
            arena.pin()
        self._copy(arena, copies)
        if on_device:
            torch.cuda.synchronize()
        return skeleton, new

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class Materializer:
    """The saver's side: turns skeletons back into state dicts over the arena it was sent."""

    def __init__(self) -> None:
        self.arena: Arena | None = None
        self._meshes: dict[tuple[str, str, tuple[str, ...] | None], Any] = {}

    def attach(self, fd: int, nbytes: int, generation: int) -> None:
        if self.arena is not None:
            self.arena.close()
        self.arena = Arena(fd, nbytes, generation=generation)

    def _mesh(self, ref: DTensorRef) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        key = ("cpu", repr(ref.mesh), ref.mesh_dim_names)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh("cpu", ref.mesh, mesh_dim_names=ref.mesh_dim_names)
        return self._meshes[key]

    def build(self, obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            if self.arena is None:
                raise CheckpointError("the saver was sent tensors before it was sent their arena")
            return self.arena.tensor(obj)
        if isinstance(obj, DTensorRef):
            return DTensor.from_local(self.build(obj.local), self._mesh(obj), obj.placements, run_check=False,
                                      shape=torch.Size(obj.shape), stride=obj.stride)
        if isinstance(obj, dict):
            return {k: self.build(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.build(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.build(v) for v in obj)
        return obj
