"""A small deterministic job that checkpoints through Trainyard's client library, for the chaos suite.

The state is one float64 tensor advanced by a fixed rule each step (with an all-reduce across the gang, so
the ranks stay in lock step over gloo). Exact arithmetic makes the state at step s known in advance: on a
resume the loaded tensor must equal a replay of s steps from scratch, bit for bit. A mismatch means a
checkpoint came back with other contents than it was committed with; the program then records it and
exits 42.

Rank 0 appends one JSON line per event to $CHAOS_EVENTS_DIR/<job_id>.jsonl (start, resume, mismatch, end),
which the suite reads for its report.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from trainyard_checkpoint.client import CheckpointClient

MISMATCH_EXIT = 42


def initial(numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float64) / numel


def advance(x: torch.Tensor, step: int, reduced: float) -> torch.Tensor:
    return x * 0.5 + (float(step) + reduced)


def replay(numel: int, step: int, world: int) -> torch.Tensor:
    # The all-reduced sum of the ranks' numbers is world*(world-1)/2 on every rank.
    x = initial(numel)
    for s in range(1, step + 1):
        x = advance(x, s, world * (world - 1) / 2)
    return x


def record(event: str, **fields: object) -> None:
    where = os.environ.get("CHAOS_EVENTS_DIR", "")
    if not where or int(os.environ.get("RANK", "0")) != 0:
        return
    line = json.dumps({"event": event, "job_id": os.environ.get("TRAINYARD_JOB_ID", ""),
                       "attempt": int(os.environ.get("TRAINYARD_ATTEMPT", "0")), "at": time.time(), **fields})
    fd = os.open(os.path.join(where, f"{os.environ.get('TRAINYARD_JOB_ID', 'unknown')}.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=0.2)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    state = {"x": initial(args.numel)}
    client = CheckpointClient.from_env()
    start = client.load_latest(state) or 0
    if start:
        expected = replay(args.numel, start, world)
        if not torch.equal(state["x"], expected):
            diff = int((state["x"] != expected).sum())
            record("mismatch", step=start, differing=diff)
            print(f"CHAOS: checkpoint of step {start} restored other contents ({diff} elements differ)", flush=True)
            os._exit(MISMATCH_EXIT)
        record("resume", step=start)
    record("start", step=start, world=world)
    print(f"starting at step {start + 1} of {args.steps}", flush=True)
    for step in range(start + 1, args.steps + 1):
        t = torch.tensor([float(int(os.environ.get("RANK", "0")))], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t)
        state["x"] = advance(state["x"], step, t.item())
        time.sleep(args.step_s)
        if step % args.every == 0:
            if args.async_save:
                client.async_save(state, step)
            else:
                client.save(state, step)
    client.close()
    record("end", step=args.steps)
    print(f"done at step {args.steps}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
