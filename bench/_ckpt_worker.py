"""One rank of the checkpoint benchmark's resharding runs (started by bench/_checkpoint_trainyard.py):
`save` writes the benchmark state as DTensors sharded on dim 0 over this job's ranks, `load` reads the
latest checkpoint into the same global state sharded over however many ranks this run has, and checks it.
Prints one JSON line: {"rank": r, "seconds": t}."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainyard_checkpoint.client import CheckpointClient


def main() -> int:
    mode, gib, tensors = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    per = int(gib * (1 << 30) / tensors / 4)
    state = {}
    for i in range(tensors):
        # A load goes into written memory, as in bench/checkpoint.py.
        full = torch.randn(per, generator=torch.Generator().manual_seed(i)) if mode == "save" else torch.zeros(per)
        state[f"layer{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)])
    client = CheckpointClient.from_env()
    dist.barrier()
    t0 = time.perf_counter()
    if mode == "save":
        client.save(state, 1)
    else:
        assert client.load_latest(state) == 1
    took = time.perf_counter() - t0
    if mode == "load":  # bit-exact against the generator, on this rank's shard
        for i in range(tensors):
            local = state[f"layer{i}.weight"].to_local()
            full = torch.randn(per, generator=torch.Generator().manual_seed(i))
            start = state[f"layer{i}.weight"].device_mesh.get_local_rank() * ((per + dist.get_world_size() - 1)
                                                                                // dist.get_world_size())
            assert torch.equal(local, full[start:start + local.numel()]), f"layer{i} differs"
    client.close()
    print(json.dumps({"rank": dist.get_rank(), "seconds": took}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
