"""Run benchmarks: `python -m bench [name ...]`."""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

import bench

RESULTS = Path(__file__).resolve().parent / "results"


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def run_one(name: str) -> dict[str, float]:
    module = importlib.import_module(f"bench.{name}")
    started = time.monotonic()
    figures: dict[str, float] = module.run()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    width = max(len(k) for k in figures)
    print(f"\n== {name} ({time.monotonic() - started:.1f}s) ==")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value:.4g}")
    print(f"  -> {RESULTS / (name + '.json')}")
    return figures


def main(argv: list[str]) -> int:
    names = [a for a in argv if a] or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    for name in names:
        run_one(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
