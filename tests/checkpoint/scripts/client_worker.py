"""A training process for the client tests, started once per rank by tests/checkpoint/scripts/gang.py.

    client_worker.py save STEP [STEP...]      save the state of each step (sync)
    client_worker.py load                     load_latest into an empty state, compare bit for bit
    client_worker.py resume STEP              load, then save the state of STEP
    client_worker.py async                    the async_save scenario (see run_async)
    client_worker.py async-crash              a saver killed mid-save (see run_async_crash)

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a gloo group is formed when WORLD_SIZE > 1 or
USE_DIST=1), the TRAINYARD_* variables of a job, and OUT: the directory for `rank<N>.json`, this rank's
report.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import client_state
import torch
import torch.distributed as dist

from trainyard_checkpoint.client import CheckpointClient, CheckpointError

log = logging.getLogger("client_worker")


def report(data: dict[str, Any]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(data, f)


def run_save(client: CheckpointClient, steps: list[int], distributed: bool, world: int) -> dict[str, Any]:
    saved = []
    for step in steps:
        info = client.save(client_state.build(step, distributed=distributed, world_size=world), step)
        saved.append({"step": step, "id": info.id, "location": info.location, "state": info.state,
                      "shards": [[s.path, s.size_bytes, s.checksum, s.rank] for s in info.shards]})
    return {"saved": saved, "digests": {str(s): client_state.digests(s) for s in steps}}


def run_load(client: CheckpointClient, distributed: bool, world: int) -> dict[str, Any]:
    state = client_state.build(0, distributed=distributed, world_size=world, empty=True)
    step = client.load_latest(state)
    outcome = client.last_load
    assert outcome is not None
    return {"step": step, "checkpoint": outcome.checkpoint.id if outcome.checkpoint else None,
            "skipped": [{"id": s.checkpoint_id, "step": s.step, "problems": list(s.problems)} for s in outcome.skipped],
            "mismatches": client_state.mismatches(state, step) if step is not None else []}


def run_async(client: CheckpointClient, distributed: bool, world: int) -> dict[str, Any]:
    """Two async saves. After each call returns, training changes every tensor in place at once, and keeps
    stepping while the save persists; the checkpoints must hold the values at the time of the call."""
    state = client_state.build(1, distributed=distributed, world_size=world)
    first = client.async_save(state, 1)
    done_at_return = first.done()
    steps_during = 0
    while not first.wait(timeout=0.002):  # a GPU-bound trainer mostly waits for its device
        bump(state)  # "training": the values the save must not see
        steps_during += 1
    info1 = first.result(timeout=120)
    # The second save is called while the first... is done; call a third right after to see the wait.
    state = client_state.build(2, distributed=distributed, world_size=world)
    second = client.async_save(state, 2)
    bump(state)
    state3 = client_state.build(3, distributed=distributed, world_size=world)
    third = client.async_save(state3, 3)
    second_done_when_third_returned = second.done()
    bump(state3)
    info2, info3 = second.result(timeout=120), third.result(timeout=120)
    loaded = client_state.build(0, distributed=distributed, world_size=world, empty=True)
    loaded_step = client.load_latest(loaded)
    return {
        "done_at_return": done_at_return, "steps_during": steps_during,
        "second_done_when_third_returned": second_done_when_third_returned,
        "ids": [info1.id, info2.id, info3.id], "states": [info1.state, info2.state, info3.state],
        "timings": [{"blocking_s": h.blocking_s, "staging_s": h.staging_s, "waited_s": h.waited_s,
                     "total_s": h.total_s} for h in (first, second, third)],
        "pid": os.getpid(), "saver_pids": [h.saver_pid for h in (first, second, third)],
        "loaded_step": loaded_step, "mismatches": client_state.mismatches(loaded, 3),
    }


def run_async_crash(client: CheckpointClient, distributed: bool, world: int) -> dict[str, Any]:
    """Rank 0's saver is killed in the middle of the first save (TRAINYARD_TEST_KILL_AT=0:<n>): both ranks'
    handles must fail (not hang), and the next async save must work on fresh savers."""
    first = client.async_save(client_state.build(1, distributed=distributed, world_size=world), 1)
    try:
        first.result(timeout=120)
        error = ""
    except CheckpointError as e:
        error = str(e)
    second = client.async_save(client_state.build(2, distributed=distributed, world_size=world), 2)
    info = second.result(timeout=120)
    loaded = client_state.build(0, distributed=distributed, world_size=world, empty=True)
    return {"error": error, "saver_pids": [first.saver_pid, second.saver_pid], "second": info.id,
            "second_state": info.state, "loaded_step": client.load_latest(loaded),
            "mismatches": client_state.mismatches(loaded, 2)}


def bump(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for group in ("model", "optim"):
            for value in state[group].values():
                local = value.to_local() if hasattr(value, "to_local") else value
                local.add_(1)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {os.environ.get('RANK', '0')} %(name)s %(levelname)s %(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1 or os.environ.get("USE_DIST") == "1"
    if distributed:
        dist.init_process_group("gloo")
    started = time.perf_counter()
    with CheckpointClient.from_env() as client:
        command = argv[1]
        if command == "save":
            result = run_save(client, [int(s) for s in argv[2:]], distributed, world)
        elif command == "load":
            result = run_load(client, distributed, world)
        elif command == "async":
            result = run_async(client, distributed, world)
        elif command == "resume":  # load the latest intact checkpoint, then save at STEP
            loaded = run_load(client, distributed, world)
            result = {"loaded": loaded, **run_save(client, [int(argv[2])], distributed, world)}
        elif command == "async-crash":
            result = run_async_crash(client, distributed, world)
        else:
            raise SystemExit(f"unknown command {command!r}")
    result["elapsed_s"] = time.perf_counter() - started
    report(result)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
