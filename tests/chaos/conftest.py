"""Settings of the chaos suite, from the environment:

    CHAOS_SEED          the run's seed (default: a fresh random one, printed); replays a run's plan
    CHAOS_DURATION_S    seconds of faults (default 100: the whole test takes about 3 minutes)
    CHAOS_SETTLE_S      deadline for every job to end after the faults stop and the cluster is healed
                        (default 150)
    CHAOS_MAX_IN_FLIGHT unfinished jobs at a time (default 4; the host has few cores)
    CHAOS_FAULTS        only these fault kinds, comma-separated (default: all; see schedule.FAULT_WEIGHTS),
                        to narrow a failure down; the plan depends on the seed, the duration and this

`make chaos` runs the long schedule (CHAOS_DURATION_S=900 unless set).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: random faults against a real local cluster (tests/chaos)")


@dataclass(frozen=True)
class ChaosSettings:
    seed: int
    duration_s: float
    settle_s: float
    max_in_flight: int
    faults: frozenset[str] | None = None

    def replay(self) -> str:
        only = f"CHAOS_FAULTS={','.join(sorted(self.faults))} " if self.faults else ""
        return (f"CHAOS_SEED={self.seed} CHAOS_DURATION_S={self.duration_s:g} {only}"
                ".venv/bin/python -m pytest tests/chaos")


@pytest.fixture
def chaos_settings() -> ChaosSettings:
    seed = os.environ.get("CHAOS_SEED", "").strip()
    kinds = os.environ.get("CHAOS_FAULTS", "")
    return ChaosSettings(seed=int(seed) if seed else secrets.randbelow(2**31),
                         duration_s=float(os.environ.get("CHAOS_DURATION_S", "70")),
                         settle_s=float(os.environ.get("CHAOS_SETTLE_S", "150")),
                         max_in_flight=int(os.environ.get("CHAOS_MAX_IN_FLIGHT", "4")),
                         faults=frozenset(k.strip() for k in kinds.split(",") if k.strip()) or None)
