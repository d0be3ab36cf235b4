"""A minimal torch.distributed program, as Trainyard runs it: it reads only the standard environment
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, ...). gloo on CPU; use "nccl" on GPUs."""

import os
import socket

import torch
import torch.distributed as dist

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
t = torch.tensor([float(rank)], device="cuda" if backend == "nccl" else "cpu")
dist.all_reduce(t)
print(f"rank {rank}/{world} on {socket.gethostname()} (node {os.environ['NODE_RANK']}, "
      f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): sum of ranks = {t.item():g}")
dist.destroy_process_group()
