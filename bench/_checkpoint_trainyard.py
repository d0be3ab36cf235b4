"""The Trainyard half of bench/checkpoint.py: a real etcd and checkpoint-store process (default settings:
commit reads every shard back and verifies its checksum), the client library in this process for the
single-rank figures, and gloo processes for the resharding figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainyard_checkpoint.client import CheckpointClient, ClientSettings
from trainyard_cli.local import Proc
from trainyard_core.ids import new_id
from trainyard_core.testing.etcd import free_port, start_single, stop_and_clean

from .checkpoint import Config, evict, load_target, state_bytes


def _store(root: Path, endpoint: str) -> tuple[Proc, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({"TRAINYARD_CHECKPOINT_STORE_ETCD_ENDPOINTS": endpoint,
                "TRAINYARD_CHECKPOINT_STORE_LISTEN_PORT": str(port),
                "TRAINYARD_CHECKPOINT_STORE_STORAGE_URL": (root / "store").as_uri(),
                "TRAINYARD_CHECKPOINT_STORE_READY_FILE": str(root / "store.ready"), "PYTHONUNBUFFERED": "1",
                # Workers reach the store without a certificate until per-job worker credentials exist.
                "TRAINYARD_CHECKPOINT_STORE_INSECURE_PLAINTEXT": "true"})
    (root / "store").mkdir(parents=True, exist_ok=True)
    proc = Proc(name="checkpoint-store", args=[sys.executable, "-m", "trainyard_checkpoint.main"], env=env,
                log_path=root / "store.log", ready_path=root / "store.ready")
    proc.start()
    proc.wait_ready()
    return proc, f"127.0.0.1:{port}"


def measure(state: dict[str, torch.Tensor], root: Path, config: Config) -> dict[str, float]:
    member = start_single()
    proc, address = _store(root, member.endpoint)
    try:
        return _measure(state, root, address, config)
    finally:
        proc.stop()
        stop_and_clean(member)


def _measure(state: dict[str, torch.Tensor], root: Path, address: str, config: Config) -> dict[str, float]:
    gib = state_bytes(state) / (1 << 30)
    f: dict[str, float] = {}
    repeats = config.repeats
    settings = ClientSettings(store_address=address, job_id=new_id("job"), attempt=1,
                              thread_count=config.threads, insecure_plaintext=True)
    step = 0
    with CheckpointClient(settings) as client:
        saves = []
        for _ in range(repeats):
            step += 1
            t0 = time.perf_counter()
            client.save(state, step)
            saves.append(time.perf_counter() - t0)
        f["save_s"] = min(saves)
        f["save_gib_s"] = gib / f["save_s"]
        blocking, totals = [], []
        for _ in range(repeats + 1):  # the first one also starts the saver process
            step += 1
            handle = client.async_save(state, step)
            handle.result()
            blocking.append(handle.blocking_s)
            totals.append(handle.total_s or 0.0)
        f["async_blocking_s"] = min(blocking[1:])
        f["async_total_s"] = min(totals[1:])
        f["async_first_blocking_s"] = blocking[0]
        loads = []
        for _ in range(repeats):
            evict(root / "store")
            target = load_target(state)
            t0 = time.perf_counter()
            assert client.load_latest(target) == step
            loads.append(time.perf_counter() - t0)
            assert all(torch.equal(target[k], state[k]) for k in state)
        f["load_s"] = min(loads)
        f["load_gib_s"] = gib / f["load_s"]
    f.update(_reshard(root, address, config))
    return f


def _gang(mode: str, world: int, job_id: str, address: str, config: Config) -> float:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")},
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "TRAINYARD_CHECKPOINT_STORE": address,
               "TRAINYARD_JOB_ID": job_id, "TRAINYARD_ATTEMPT": "1", "OMP_NUM_THREADS": "1",
               "TRAINYARD_CHECKPOINT_PLAINTEXT": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "bench._ckpt_worker", mode, str(config.reshard_gib),
                                       str(config.tensors)], env=env, stdout=subprocess.PIPE, text=True))
    seconds = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{mode} rank exited {p.returncode}")
        seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
    return max(seconds)


def _reshard(root: Path, address: str, config: Config) -> dict[str, float]:
    job = new_id("job")
    out: dict[str, Any] = {"reshard_state_gib": config.reshard_gib}
    out["reshard_save_2ranks_s"] = _gang("save", 2, job, address, config)
    times = {}
    for world in (2, 1, 3):
        evict(root / "store")
        times[world] = _gang("load", world, job, address, config)
        out[f"load_2_to_{world}_s"] = times[world]
    out["reshard_load_vs_load"] = min(times[2] / times[1], times[2] / times[3])
    return out
