"""The environment of one worker process, layered from lowest to highest priority:

1. the agent's own environment (PATH, HOME, ... of the host); for a worker that runs as its team's own
   Unix user (`tenancy.py`), without what names the agent's user (HOME, USER, LOGNAME, MAIL, XDG_*_DIR)
   and with HOME set to the job's working directory (a worker's tools write ~/.cache and the like);
2. the agent's defaults for workers: PYTHONUNBUFFERED=1 (so logs stream instead of arriving at exit) and
   CUDA_DEVICE_ORDER=PCI_BUS_ID (so CUDA numbers GPUs as NVML does; CUDA's default puts the fastest
   first, and CUDA_VISIBLE_DEVICES indices would then point at other GPUs than the scheduler chose);
3. `worker_env` from the agent's settings (site defaults, e.g. GLOO_SOCKET_IFNAME=lo);
4. the launch request's env: the job's env plus what the scheduler sets (MASTER_ADDR, MASTER_PORT,
   WORLD_SIZE, NODE_RANK, LOCAL_WORLD_SIZE, TRAINYARD_JOB_ID, TRAINYARD_ATTEMPT, and the attempt's
   checkpoint-store credential TRAINYARD_CHECKPOINT_CERT/_KEY/_CA). The credential arrives as PEM; by the
   time the env is built here those three name the files the supervisor wrote it to (`credentials.py`),
   so the key is in no worker's environment. The env reaches a shim on its stdin, never its command line,
   and is neither logged nor written to the records;
5. per worker, set by the agent and never overridden: RANK, LOCAL_RANK, device visibility.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..model import Vendor
from .model import WorkerSpec

AGENT_DEFAULTS = {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
# Variables of the agent's environment that name its own user: another user's worker must not get them.
AGENT_USER_VARS = ("HOME", "USER", "LOGNAME", "MAIL", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME",
                   "XDG_DATA_HOME", "XDG_STATE_HOME")


def device_env(vendor: Vendor, gpu_indices: tuple[int, ...]) -> dict[str, str]:
    devices = ",".join(str(i) for i in gpu_indices)
    # Always set, also when empty: an empty list hides every GPU from a CPU-only worker.
    env = {"CUDA_VISIBLE_DEVICES": devices}
    if vendor is Vendor.AMD:
        env["HIP_VISIBLE_DEVICES"] = devices
        env["ROCR_VISIBLE_DEVICES"] = devices
    return env


def worker_env(
    *,
    base: Mapping[str, str],
    site_defaults: Mapping[str, str],
    request_env: Mapping[str, str],
    worker: WorkerSpec,
    vendor: Vendor,
    node_id: str,
    home: str = "",
) -> dict[str, str]:
    """`home`: the worker runs as another user than the agent's, with this HOME unless the job sets one."""
    if home:
        base = {**{k: v for k, v in base.items() if k not in AGENT_USER_VARS}, "HOME": home}
    env = {**base, **AGENT_DEFAULTS, **site_defaults, **request_env}
    env.update(device_env(vendor, worker.gpu_indices))
    env["RANK"] = str(worker.rank)
    env["LOCAL_RANK"] = str(worker.local_rank)
    env["TRAINYARD_NODE_ID"] = node_id
    return env
