"""One save, run by every rank of a gang (SPMD): the trainer runs it for `save`, the saver process for
`async_save`.

    rank 0: Begin ──broadcast id+location──▶ all ranks: DCP save (each rank writes its files in parallel
    threads, checksummed as written, fsync'ed) ──DCP gather of results──▶ rank 0: .metadata, Commit of
    every rank's files ──broadcast──▶ all ranks return the committed checkpoint

Any rank's failure reaches every rank through DCP's collectives; rank 0 then aborts the checkpoint (best
effort: a WRITING checkpoint left behind by a crash is aborted by the service's GC) and every rank raises
CheckpointError. Nothing is ever COMMITTED unless every file of every rank was written, fsync'ed and
declared with its size and checksum.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .env import ClientSettings
from .errors import CheckpointError, from_dcp
from .faults import KillPoints
from .gang import Gang
from .service import CheckpointInfo, ServiceClient, ShardRecord
from .writer import TrainyardWriter

log = logging.getLogger(__name__)

FORMAT = "torch.distributed.checkpoint"


def begin_metadata(extra: Mapping[str, str] | None) -> dict[str, str]:
    return {"format": FORMAT, "torch_version": str(torch.__version__), **(extra or {})}


def save_collective(state_dict: dict[str, Any], step: int, *, gang: Gang, settings: ClientSettings,
                    service: Callable[[], ServiceClient], points: KillPoints,
                    metadata: Mapping[str, str] | None = None,
                    planner: SavePlanner | None = None) -> CheckpointInfo:
    begun: CheckpointInfo | CheckpointError | None = None
    if gang.rank == 0:
        try:
            begun = service().begin(job_id=settings.job_id, attempt=settings.attempt, step=step,
                                    world_size=gang.world_size, metadata=begin_metadata(metadata),
                                    code_version=settings.code_version, retention=settings.retention)
        except CheckpointError as e:
            begun = e
    begun = gang.broadcast(begun)
    if not isinstance(begun, CheckpointInfo):
        raise begun if isinstance(begun, CheckpointError) else CheckpointError(f"Begin answered {begun!r}")
    ckpt: CheckpointInfo = begun
    points.hit("begun")

    committed: list[CheckpointInfo] = []

    def commit(files: list[ShardRecord]) -> None:
        points.hit("before commit")
        committed.append(service().commit(ckpt.id, files))
        points.hit("after commit")

    what = f"saving step {step} as checkpoint {ckpt.id}"
    error: CheckpointError | None = None
    try:
        writer = TrainyardWriter(ckpt.location, thread_count=settings.thread_count,
                                 chunk_bytes=settings.chunk_bytes, sync_files=settings.sync_files,
                                 on_complete=commit if gang.rank == 0 else None, points=points)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(state_dict, storage_writer=writer, planner=planner, process_group=gang.group,
                     no_dist=not gang.distributed)
    except CheckpointException as e:
        error = from_dcp(e, what)
    except CheckpointError as e:
        error = e
    except Exception as e:  # a local failure before DCP's first collective
        error = CheckpointError(f"{what} failed on rank {gang.rank}: {type(e).__name__}: {e}")
    if error is not None:
        if gang.rank == 0:
            try:
                service().abort(ckpt.id, str(error)[:1024])
            except CheckpointError as abort_error:
                log.warning("could not abort checkpoint %s: %s", ckpt.id, abort_error)
        gang.settle()
        raise error
    result = gang.broadcast(committed[0] if committed else None)
    gang.settle()
    if not isinstance(result, CheckpointInfo):
        raise CheckpointError(f"{what}: rank 0 has no committed checkpoint to report")
    points.hit("saved")
    log.info("checkpoint %s committed (step %d, %d files, %d bytes)", result.id, result.step,
             len(result.shards), result.total_bytes)
    return result
