"""Checkpoint save and load against this machine's disk, every figure next to a baseline from the same run.

State: `gib` GiB of float32 tensors (`tensors` of them; 1 GiB in 16, TINY 16 MiB in 4), on CPU. Files live
under `dir` (BENCH_CHECKPOINT_DIR; default a fresh directory in the system temp dir, on the same disk as the
repository here). Before every read
measurement the files are evicted from the page cache (posix_fadvise DONTNEED after fsync), so reads
come from the disk, as after a restart on another node. Loads go into tensors that have been written before
the clock starts, as a restarted trainer's initialized model is: the raw read's buffer is warm too, and a
fresh `empty_like` would charge each load the kernel's allocation and zeroing of 1 GiB of new pages
(~0.25 s here, a quarter of the read itself).

Baselines:
- raw write: `dd bs=64M conv=fdatasync` of the same number of bytes (and `oflag=direct`, reported beside);
- raw read: `dd bs=64M iflag=direct` of that file;
- `torch.save` of the state to one file + fsync (the synchronous save a training loop would block on);
- stock DCP `FileSystemWriter` with 1 and with N threads (`dcp.save`, no process group).
Trainyard: the client library's synchronous save (bandwidth) and async_save (time the training loop is
blocked, and time until committed), load_latest (bandwidth, checksums verified), and loads that reshard a
2-rank checkpoint onto 1 and 3 ranks (gloo processes), relative to a 2-rank load of the same checkpoint.
Checksum: the shard checksum (chunked XXH3) of the state in memory, on one thread.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


@dataclass(frozen=True)
class Config:
    gib: float = 1.0
    tensors: int = 16
    threads: int = 4
    repeats: int = 2               # each figure is the best of this many runs (this machine is shared and noisy)
    reshard_gib: float = 0.5       # the state the 1/2/3-rank resharding runs save and load
    dir: str = ""                  # where the files go; empty: a fresh directory in the system temp dir


TINY = Config(gib=1 / 64, tensors=4, repeats=1, reshard_gib=1 / 128)


def make_state(gib: float, tensors: int) -> dict[str, torch.Tensor]:
    per = int(gib * (1 << 30) / tensors / 4)
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def evict(path: Path) -> None:
    """Drop a file's (or a directory's files') pages from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    for f in [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def best(fn: Callable[[], float], repeats: int) -> float:
    """The shortest of `repeats` runs (seconds)."""
    return min(fn() for _ in range(repeats))


def dd_write(path: Path, nbytes: int, direct: bool = False) -> float:
    count = max(1, nbytes // (64 << 20))
    flag = "oflag=direct" if direct else "conv=fdatasync"
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", flag, "status=none"],
                   check=True)
    took = time.perf_counter() - t0
    return count * (64 << 20) / took


def dd_read(path: Path) -> float:
    evict(path)
    size = path.stat().st_size
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct", "status=none"], check=True)
    return size / (time.perf_counter() - t0)


def torch_save(state: dict[str, torch.Tensor], path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def dcp_save(state: dict[str, torch.Tensor], path: Path, threads: int) -> float:
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads, sync_files=True))
    fsync_tree(path)
    return time.perf_counter() - t0


def checksum_gib_s(state: dict[str, torch.Tensor], repeats: int) -> float:
    """Chunked XXH3 over the state's bytes in memory, one thread, as the writer and reader compute it."""
    from trainyard_checkpoint import checksum

    views = [memoryview(t.numpy()).cast("B") for t in state.values()]

    def once() -> float:
        t0 = time.perf_counter()
        for view in views:
            checksum.of_bytes(view)
        return time.perf_counter() - t0

    return state_bytes(state) / best(once, repeats + 1) / (1 << 30)


def checksum_parallel_gib_s(state: dict[str, torch.Tensor], threads: int, repeats: int) -> float:
    """The same over `threads` threads, a tensor each at a time, as the writer's threads hash their files
    (xxhash releases the GIL, so the chunks of a checksum are computed in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    from trainyard_checkpoint import checksum

    views = [memoryview(t.numpy()).cast("B") for t in state.values()]

    def once() -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(checksum.of_bytes, views))
        return time.perf_counter() - t0

    return state_bytes(state) / best(once, repeats + 1) / (1 << 30)


def load_target(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors to load `state` into: resident (written) and different from it."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


def dcp_load(state: dict[str, torch.Tensor], path: Path) -> float:
    evict(path)
    target = load_target(state)
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)))
    took = time.perf_counter() - t0
    assert all(torch.equal(target[k], state[k]) for k in state)
    return took


def run(config: Config = Config()) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="trainyard-ckpt-bench-", dir=config.dir or None))
    try:
        return _run(root, config)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(root: Path, config: Config) -> dict[str, float]:
    repeats = config.repeats
    state = make_state(config.gib, config.tensors)
    nbytes = state_bytes(state)
    gib = nbytes / (1 << 30)
    f: dict[str, float] = {"state_gib": gib}
    raw = root / "raw.bin"
    f["raw_write_gib_s"] = max(dd_write(raw, nbytes) for _ in range(repeats)) / (1 << 30)
    f["raw_write_direct_gib_s"] = max(dd_write(raw, nbytes, direct=True) for _ in range(repeats)) / (1 << 30)
    f["raw_read_gib_s"] = max(dd_read(raw) for _ in range(repeats)) / (1 << 30)
    raw.unlink()
    f["checksum_gib_s"] = checksum_gib_s(state, repeats)
    f["checksum_gib_s_threads"] = checksum_parallel_gib_s(state, config.threads, repeats)
    f["torch_save_s"] = best(lambda: torch_save(state, root / "model.pt"), repeats)
    f["torch_save_gib_s"] = gib / f["torch_save_s"]
    (root / "model.pt").unlink()
    f["dcp_save_1thread_gib_s"] = gib / best(lambda: dcp_save(state, root / "dcp1", 1), repeats)
    f["dcp_save_nthreads_gib_s"] = gib / best(lambda: dcp_save(state, root / "dcpn", config.threads), repeats)
    f["dcp_load_gib_s"] = gib / best(lambda: dcp_load(state, root / "dcpn"), repeats)
    shutil.rmtree(root / "dcp1", ignore_errors=True)
    shutil.rmtree(root / "dcpn", ignore_errors=True)
    f.update(_trainyard(state, root, config))
    base_dcp = max(f["dcp_save_1thread_gib_s"], f["dcp_save_nthreads_gib_s"])
    if "save_gib_s" in f:
        f["save_vs_raw_write"] = f["save_gib_s"] / f["raw_write_gib_s"]
        f["save_vs_dcp"] = f["save_gib_s"] / base_dcp
        f["load_vs_raw_read"] = f["load_gib_s"] / f["raw_read_gib_s"]
        f["async_stall_vs_torch_save"] = f["async_blocking_s"] / f["torch_save_s"]
    return f


def _trainyard(state: dict[str, torch.Tensor], root: Path, config: Config) -> dict[str, float]:
    """The client library's figures (filled in with the library; see bench/_checkpoint_trainyard.py)."""
    from bench._checkpoint_trainyard import measure

    return measure(state, root, config)
