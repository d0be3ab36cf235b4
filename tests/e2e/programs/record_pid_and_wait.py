"""Writes its pid (and a grandchild's) to a directory, then runs until killed."""

import os
import subprocess
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
(out / f"rank-{os.environ['RANK']}.pids").write_text(f"{os.getpid()} {child.pid}\n")
print("waiting", flush=True)
while True:
    time.sleep(1)
