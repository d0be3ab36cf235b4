"""A worker that records its start, then holds until released (or exits at once with --no-hold).

Each start leaves `start.<job>.<attempt>.<rank>.<pid>` in the directory given, so a test can count every
worker that ever ran (a second placement of a job would leave more). The job's workers exit 0 once
`release.<job>` appears there.
"""

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
job, attempt, rank = os.environ["TRAINYARD_JOB_ID"], os.environ["TRAINYARD_ATTEMPT"], os.environ["RANK"]
(out / f"start.{job}.{attempt}.{rank}.{os.getpid()}").touch(exist_ok=False)
print(f"started attempt {attempt} rank {rank} pid {os.getpid()}", flush=True)
if "--no-hold" not in sys.argv:
    release = out / f"release.{job}"
    while not release.exists():
        time.sleep(0.05)
print("released", flush=True)
