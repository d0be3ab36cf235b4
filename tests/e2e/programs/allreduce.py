"""A tiny real torch.distributed program: every rank all-reduces its rank number over gloo."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
expected = world * (world - 1) / 2
print(f"rank {rank}/{world} node {os.environ['NODE_RANK']} local {os.environ['LOCAL_RANK']} "
      f"gpu {os.environ['CUDA_VISIBLE_DEVICES']} allreduce={t.item():g} expected={expected:g}", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if t.item() == expected else 1)
