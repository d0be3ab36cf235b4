"""Run benchmarks: `python -m bench [--tiny] [--results DIR] [name ...]` (`make bench`, `make bench BENCH=name`).

Every benchmark module has a frozen dataclass `Config` whose defaults are the full benchmark, `TINY`, the same
code paths at a size that runs in seconds (tests/bench/ runs each one so, so a change that breaks `make bench`
fails `make test`), and `run(config) -> dict[str, float]`.

This is the one place that reads the environment for the benchmarks: `BENCH_SIZE=tiny` (or `--tiny`) picks
TINY, and `BENCH_<NAME>_<FIELD>=value` overrides one field of that benchmark's Config (e.g.
`BENCH_RECOVERY_ROUNDS=10`, `BENCH_CHECKPOINT_GIB=4`, `BENCH_CHECKPOINT_DIR=/mnt/nvme/tmp`).

Exit status: 0 when every benchmark ran and returned its figures — a figure that misses its target is a
result, printed as such, never an error; 1 when any benchmark crashed (the others still run, and the crash is
named at the end); 2 for an unknown benchmark name or a bad override.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pkgutil
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import bench

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = ("full", "tiny")


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def config_for(module: ModuleType, name: str, size: str, env: Mapping[str, str]) -> Any:
    """The module's Config for `size`, with the `BENCH_<NAME>_<FIELD>` overrides found in `env` applied."""
    base = module.TINY if size == "tiny" else module.Config()
    overrides: dict[str, Any] = {}
    for f in dataclasses.fields(base):
        raw = env.get(f"BENCH_{name.upper()}_{f.name.upper()}")
        if raw is None:
            continue
        kind = type(getattr(base, f.name))
        try:
            overrides[f.name] = (raw.lower() in ("1", "true", "yes")) if kind is bool else kind(raw)
        except ValueError as exc:
            raise ValueError(f"BENCH_{name.upper()}_{f.name.upper()}={raw!r}: not a {kind.__name__}") from exc
    return dataclasses.replace(base, **overrides)


def check_figures(name: str, figures: object) -> dict[str, float]:
    """A benchmark returns a non-empty flat object of figure name → number (NaN allowed: a bucket with no
    samples); anything else is a bug in the benchmark, reported as its crash."""
    if not isinstance(figures, dict) or not figures:
        raise TypeError(f"{name}.run() returned {type(figures).__name__}, not a non-empty dict of figures")
    bad = {k: v for k, v in figures.items()
           if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float)}
    if bad:
        raise TypeError(f"{name}.run() returned figures that are not numbers: {bad!r}")
    return {k: float(v) for k, v in figures.items()}


def run_one(name: str, size: str = "full", results: Path = RESULTS,
            env: Mapping[str, str] = os.environ) -> dict[str, float]:
    module = importlib.import_module(f"bench.{name}")
    config = config_for(module, name, size, env)
    started = time.monotonic()
    figures = check_figures(name, module.run(config))
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{name}.json"
    # NaN is written as JSON's NaN extension (json.loads reads it back), as before.
    out.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    width = max(len(k) for k in figures)
    label = "" if size == "full" else f", {size}"
    print(f"\n== {name} ({time.monotonic() - started:.1f}s{label}) ==")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value:.4g}" + ("" if math.isfinite(value) else "  (no samples)"))
    print(f"  -> {out}", flush=True)
    return figures


def main(argv: list[str], env: Mapping[str, str] = os.environ) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n", 1)[0])
    parser.add_argument("names", nargs="*", metavar="name", help=f"benchmarks to run (default all: "
                        f"{', '.join(available())})")
    parser.add_argument("--tiny", action="store_true", help="each benchmark's TINY config (also BENCH_SIZE=tiny)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"where <name>.json go (default {RESULTS})")
    args = parser.parse_args([a for a in argv if a])
    size = "tiny" if args.tiny else env.get("BENCH_SIZE", "full") or "full"
    if size not in SIZES:
        print(f"BENCH_SIZE={size!r}: one of {', '.join(SIZES)}", file=sys.stderr)
        return 2
    names = args.names or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    for name in names:  # a bad override is found before anything runs, not an hour in
        try:
            config_for(importlib.import_module(f"bench.{name}"), name, size, env)
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    crashed: list[str] = []
    started = time.monotonic()
    for name in names:
        try:
            run_one(name, size, args.results, env)
        except Exception:  # one benchmark's crash must not hide the others' figures
            traceback.print_exc()
            print(f"\n== {name}: CRASHED (traceback above) ==", file=sys.stderr, flush=True)
            crashed.append(name)
    print(f"\n{len(names) - len(crashed)}/{len(names)} benchmark(s) ran in {time.monotonic() - started:.0f}s"
          + (f"; crashed: {', '.join(crashed)}" if crashed else ""))
    return 1 if crashed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
