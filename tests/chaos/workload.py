"""The job stream of a chaos run: real small jobs submitted through the gateway, a bounded number in flight.

Every submit carries an Idempotency-Key, so a submit whose answer was lost (a gateway call during a
scheduler failover) is simply sent again: the set of accepted jobs is exactly known. Every job's env
carries the run's marker, which is how the checker finds the jobs' processes in /proc.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .schedule import JobPlan

log = logging.getLogger(__name__)

PROGRAM = Path(__file__).resolve().parent / "programs" / "train.py"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
MARKER = "CHAOS_RUN_ID"


def job_spec(plan: JobPlan, *, run_id: str, events_dir: Path) -> dict[str, Any]:
    py = shlex.quote(sys.executable)
    if plan.kind in ("ckpt", "ckpt_gang"):
        command = [sys.executable, str(PROGRAM), "--steps", str(plan.steps), "--every", str(plan.every),
                   "--step-s", f"{plan.run_s:.3f}", *(["--async-save"] if plan.async_save else [])]
    elif plan.kind == "flaky":
        # An application failure on the first attempt, success afterwards.
        command = ["sh", "-c", f'if [ "$TRAINYARD_ATTEMPT" = 1 ]; then sleep 1; exit 3; fi; '
                               f'exec {py} -c "import time; time.sleep({plan.run_s:.2f})"']
    else:
        command = [sys.executable, "-c", f"import time; time.sleep({plan.run_s:.2f})"]
    spec: dict[str, Any] = {
        "name": plan.name, "command": command,
        "env": {MARKER: run_id, "CHAOS_EVENTS_DIR": str(events_dir)},
        "resources": {"nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node, "allow_mixed": True},
        "max_restarts": plan.max_restarts, "restart_backoff_s": plan.backoff_s,
        "labels": {"chaos-kind": plan.kind},
    }
    if plan.kind in ("ckpt", "ckpt_gang"):
        spec["checkpoint"] = {"every_steps": plan.every, "keep_last": plan.keep_last}
    return spec


@dataclass
class Accepted:
    plan: JobPlan
    job_id: str
    accepted_at: float
    cancel_sent: bool = False


@dataclass
class Workload:
    http: httpx.AsyncClient
    run_id: str
    events_dir: Path
    max_in_flight: int = 4
    accepted: dict[str, Accepted] = field(default_factory=dict)
    submit_errors: int = 0
    cancels: int = 0
    # job id → last state seen through the gateway (kept fresh by `_poll`).
    states: dict[str, str] = field(default_factory=dict)

    def in_flight(self) -> int:
        return sum(1 for j in self.accepted if self.states.get(j, "pending") not in TERMINAL)

    async def run(self, jobs: tuple[JobPlan, ...], stop: asyncio.Event) -> None:
        """Submit from `jobs` in order while fewer than `max_in_flight` are unfinished, until `stop`."""
        pending = list(jobs)
        while pending and not stop.is_set():
            await self._poll()
            await self._cancel_due()
            if self.in_flight() < self.max_in_flight:
                plan = pending.pop(0)
                await self._submit(plan, stop)
                continue
            await _sleep_unless(stop, 0.5)
        # Cancels already due still go out, so a planned cancel is not silently dropped.
        await self._cancel_due()

    async def _submit(self, plan: JobPlan, stop: asyncio.Event) -> None:
        spec = job_spec(plan, run_id=self.run_id, events_dir=self.events_dir)
        key = f"{self.run_id}-{plan.index}"
        while not stop.is_set():
            try:
                r = await self.http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": key})
            except httpx.TransportError as exc:
                self.submit_errors += 1
                log.info("submit of %s: %s; retrying", plan.name, exc)
            else:
                if r.status_code in (200, 201):
                    job = r.json()
                    self.accepted[job["id"]] = Accepted(plan, job["id"], time.monotonic())
                    self.states[job["id"]] = job["state"]
                    return
                if r.status_code < 500 and r.status_code != 429:
                    raise AssertionError(f"the gateway refused job {plan.name}: {r.status_code} {r.text}")
                self.submit_errors += 1
            await _sleep_unless(stop, 0.5)

    async def _poll(self) -> None:
        for job_id in [j for j in self.accepted if self.states.get(j) not in TERMINAL]:
            try:
                r = await self.http.get(f"/v1/jobs/{job_id}")
            except httpx.TransportError:
                return
            if r.status_code == 200:
                self.states[job_id] = r.json()["state"]

    async def _cancel_due(self) -> None:
        now = time.monotonic()
        for a in self.accepted.values():
            if a.cancel_sent or a.plan.cancel_after_s is None or now - a.accepted_at < a.plan.cancel_after_s:
                continue
            if self.states.get(a.job_id) in TERMINAL:
                a.cancel_sent = True
                continue
            try:
                r = await self.http.post(f"/v1/jobs/{a.job_id}:cancel")
            except httpx.TransportError:
                continue
            if r.status_code in (200, 202):
                a.cancel_sent = True
                self.cancels += 1


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
