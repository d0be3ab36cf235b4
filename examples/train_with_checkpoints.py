"""A tiny, deterministic data-parallel training script that checkpoints with Trainyard.

Under Trainyard every worker already has the environment it needs (TRAINYARD_CHECKPOINT_STORE,
TRAINYARD_JOB_ID, TRAINYARD_ATTEMPT, the attempt's checkpoint-store credential, RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). By hand, against a local cluster (`make run` prints the checkpoint-store's
address and writes it to .trainyard/local.env; the store serves mTLS, so mint the job a credential):

    set -a; . .trainyard/local.env; set +a
    eval "$(.venv/bin/trainyard local credential job-demo)"
    TRAINYARD_JOB_ID=job-demo \
        torchrun --nproc-per-node 2 examples/train_with_checkpoints.py --steps 200 --every 20

It resumes from the job's latest intact checkpoint when there is one (after a restart, on any number of
workers), saves every `--every` steps with `async_save` (training continues while a separate process
writes), and waits for the last save before exiting. The model, optimizer and data are seeded, so a run
that is killed and resumed ends with exactly the weights of a run that never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from trainyard_checkpoint.client import CheckpointClient


class TrainState(Stateful):
    """Model and optimizer as one checkpointable object (DCP calls state_dict / load_state_dict)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x @ torch.linspace(-1, 1, 16 * 4).view(16, 4) + 0.1 * torch.randn(32, 4, generator=g)


def main() -> int:
    parser = argparse.ArgumentParser(description="tiny training loop with Trainyard checkpoints")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="save every N steps")
    parser.add_argument("--sync", action="store_true", help="save with the blocking save() instead")
    parser.add_argument("--stop-after", type=int, default=0, help="exit abruptly after this step (a crash)")
    parser.add_argument("--out", default="", help="write a JSON summary here (rank 0)")
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep this long per step (a slower demo)")
    parser.add_argument("--log-steps", action="store_true", help="rank 0 prints each step with its wall time")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"train": TrainState(model, optimizer)}

    checkpoints = CheckpointClient.from_env()
    start = checkpoints.load_latest(state) or 0
    if rank == 0:
        print(f"starting at step {start + 1}" + (" (resumed)" if start else ""), flush=True)

    loss = torch.tensor(float("nan"))
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.log_steps and rank == 0:
            print(f"step {step} at {time.time():.3f}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
        if step % args.every == 0:
            if args.sync:
                checkpoints.save(state, step)
            else:
                checkpoints.async_save(state, step)  # returns once the state is copied to memory
        if step == args.stop_after:
            os._exit(3)  # no cleanup, as a crash would be
    checkpoints.close()  # waits for the save in flight

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
    if rank == 0:
        print(f"done at step {args.steps}, final loss {loss.item():.6f}, weights {digest[:16]}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"start": start, "steps": args.steps, "weights": digest}, f)
    if distributed:
        # Every rank leaves together: tearing down a gloo group while a peer has already exited can hang.
        dist.barrier()
        dist.destroy_process_group()
        # Then leave without running destructors. Freeing the DDP model destroys the gloo process group,
        # whose destructor joins its worker threads while holding the GIL; a worker still freeing the last
        # collective's tensors needs the GIL, so the rank can hang there for good (seen here with torch
        # 2.13: main thread in ~ProcessGroupGloo, worker in gil_scoped_acquire). Everything is saved.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
