"""A one-rank worker that saves a checkpoint (blocking `save`) about every 0.1 s through the checkpoint
client library until `stop.<job>` appears in the directory given, then exits 0.

It appends `begin <step>` / `saved <step> <seconds> <checkpoint id>` to `<job>.progress` and the client
library's log (its retries) to `<job>.client.log`. A save that fails is written as `failed <step> <why>`
and ends the worker with code 3: the client library has given up, so the job fails (and restarts, if its
restart policy allows) — the behaviour the checkpoint-store test pins down.
"""

import logging
import os
import sys
import time
from pathlib import Path

import torch

from trainyard_checkpoint.client import CheckpointClient, CheckpointError

out = Path(sys.argv[1])
job = os.environ["TRAINYARD_JOB_ID"]
logging.basicConfig(filename=out / f"{job}.client.log", level=logging.INFO,
                    format="%(asctime)s %(name)s %(levelname)s %(message)s")
progress = open(out / f"{job}.progress", "a", buffering=1)  # noqa: SIM115 - open for the worker's life
stop = out / f"stop.{job}"

model = torch.nn.Linear(32, 32)
client = CheckpointClient.from_env()
step = 0
while True:
    step += 1
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    progress.write(f"begin {step}\n")
    started = time.monotonic()
    try:
        info = client.save({"model": model.state_dict()}, step)
    except CheckpointError as e:
        progress.write(f"failed {step} {e}\n")
        raise SystemExit(3) from None
    progress.write(f"saved {step} {time.monotonic() - started:.3f} {info.id}\n")
    if stop.exists():
        break
    deadline = time.monotonic() + 0.1
    while time.monotonic() < deadline and not stop.exists():
        time.sleep(0.02)
client.close()
print(f"done after {step} saves", flush=True)
