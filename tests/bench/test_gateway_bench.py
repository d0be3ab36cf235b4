"""bench/gateway.py in its TINY configuration through `python -m bench --tiny gateway` (what `make bench
BENCH=gateway` runs, at a size that takes seconds): it writes every figure it documents, each a finite number,
with the counts it was configured with and no failed request. Nothing here times anything or checks a
target: at this size the figures say nothing about them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import gateway

REPO = Path(__file__).resolve().parents[2]

FIGURES = {
    "hello_p95_ms", "hello_throughput_rps", "get_p50_ms", "get_p95_ms", "get_throughput_rps", "list_p50_ms",
    "list_p95_ms", "list_throughput_rps", "submit_p50_ms", "submit_p99_ms", "submit_throughput_rps", "errors",
    "get_throughput_vs_hello", "get_p95_vs_hello", "list_throughput_vs_hello", "list_p95_vs_hello", "clients",
    "jobs", "submits", "job_view",
}


@pytest.mark.e2e
@pytest.mark.parametrize("job_view", [True, False], ids=["view", "scheduler-reads"])
def test_tiny_gateway_benchmark_writes_its_figures(tmp_path: Path, job_view: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env["BENCH_GATEWAY_JOB_VIEW"] = str(job_view).lower()
    proc = subprocess.run([sys.executable, "-m", "bench", "--tiny", "--results", str(tmp_path), "gateway"], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, f"`python -m bench --tiny gateway` exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    figures: dict[str, Any] = json.loads((tmp_path / "gateway.json").read_text())
    assert set(figures) >= FIGURES, sorted(FIGURES - set(figures))
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in figures.values()), figures
    tiny = gateway.TINY
    assert (figures["clients"], figures["jobs"], figures["submits"]) == (tiny.clients, tiny.jobs, tiny.submits)
    assert figures["errors"] == 0 and figures["job_view"] == float(job_view)
    assert figures["get_throughput_rps"] > 0 and figures["hello_throughput_rps"] > 0
