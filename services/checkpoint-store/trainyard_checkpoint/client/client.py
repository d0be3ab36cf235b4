"""`CheckpointClient`: what a training script uses.

    client = CheckpointClient.from_env()          # TRAINYARD_CHECKPOINT_STORE, TRAINYARD_JOB_ID, ...
    step = client.load_latest(state) or 0         # every rank; None when the job has no checkpoint yet
    ...
    handle = client.async_save(state, step)       # every rank; returns after the copy to memory
    client.save(state, step)                      # or: blocking

Every method is a collective over the process group (default: torch.distributed's default group; a job
that never initialized torch.distributed is a group of one): all ranks call it, in the same order.
Only rank 0 talks to the checkpoint-store. One save is in flight at a time: a save, async_save or
load_latest first waits for the async save in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from .async_save import AsyncSaver, SaveHandle
from .env import ClientSettings
from .faults import KillPoints
from .gang import Gang
from .loading import LoadOutcome, load_latest_collective
from .saving import save_collective
from .service import CheckpointInfo, ServiceClient

log = logging.getLogger(__name__)


class CheckpointClient:
    def __init__(self, settings: ClientSettings, *, process_group: dist.ProcessGroup | None = None) -> None:
        self.settings = settings
        self._group = process_group
        self._service: ServiceClient | None = None
        self._saver: AsyncSaver | None = None
        self._points: KillPoints | None = None
        self.last_load: LoadOutcome | None = None

    @classmethod
    def from_env(cls, *, process_group: dist.ProcessGroup | None = None) -> CheckpointClient:
        """A client configured from the worker environment (see env.py); ConfigError names what is missing."""
        return cls(ClientSettings.from_env(), process_group=process_group)

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _gang(self) -> Gang:
        return Gang(self._group)

    def service(self) -> ServiceClient:
        if self._service is None:
            self._service = ServiceClient.for_settings(self.settings)
        return self._service

    def _kill_points(self, rank: int) -> KillPoints:
        if self._points is None:
            self._points = KillPoints(self.settings.kill, rank)
        return self._points

    def wait(self) -> None:
        """Wait for the async save in flight, if any (its outcome stays with its handle)."""
        if self._saver is not None:
            self._saver.wait()

    def save(self, state_dict: dict[str, Any], step: int, *, metadata: Mapping[str, str] | None = None,
             planner: SavePlanner | None = None) -> CheckpointInfo:
        """Write `state_dict` as the checkpoint of `step` and commit it; returns the committed checkpoint.
        Raises CheckpointError (on every rank) when any rank fails; the checkpoint is then aborted."""
        self.wait()
        gang = self._gang()
        return save_collective(state_dict, step, gang=gang, settings=self.settings, service=self.service,
                               points=self._kill_points(gang.rank), metadata=metadata, planner=planner)

    def async_save(self, state_dict: dict[str, Any], step: int, *,
                   metadata: Mapping[str, str] | None = None) -> SaveHandle:
        """Snapshot `state_dict` into shared memory and return; a saver process writes and commits it.
        Training may change the tensors as soon as this returns. `handle.result()` is the committed
        checkpoint; `handle.blocking_s` what this call cost the caller."""
        if self._saver is None:
            self._saver = AsyncSaver(self.settings, self._gang())
        return self._saver.submit(state_dict, step, metadata)

    def load_latest(self, state_dict: dict[str, Any], *, planner: LoadPlanner | None = None) -> int | None:
        """Load the job's newest intact committed checkpoint into `state_dict` (in place, resharded to this
        job's world size) and return its step; None when the job has no checkpoint. A damaged checkpoint
        is logged (shard and chunk) and skipped for the previous one; `last_load` tells what happened.
        NoUsableCheckpoint when checkpoints exist but none is intact."""
        self.wait()
        gang = self._gang()
        try:
            outcome = load_latest_collective(state_dict, gang=gang, settings=self.settings, service=self.service,
                                             planner=planner)
        finally:
            gang.settle()
        self.last_load = outcome
        return outcome.step

    def close(self) -> None:
        """Wait for the async save in flight, stop the saver process, close the channel."""
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        if self._service is not None:
            self._service.close()
            self._service = None


_default: CheckpointClient | None = None


def default_client() -> CheckpointClient:
    """The process's client from the environment, created on first use."""
    global _default
    if _default is None:
        _default = CheckpointClient.from_env()
    return _default


def save(state_dict: dict[str, Any], step: int, *, metadata: Mapping[str, str] | None = None) -> CheckpointInfo:
    return default_client().save(state_dict, step, metadata=metadata)


def async_save(state_dict: dict[str, Any], step: int, *, metadata: Mapping[str, str] | None = None) -> SaveHandle:
    return default_client().async_save(state_dict, step, metadata=metadata)


def load_latest(state_dict: dict[str, Any]) -> int | None:
    return default_client().load_latest(state_dict)
