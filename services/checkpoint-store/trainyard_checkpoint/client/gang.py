"""The group of processes a save or a load runs over: a torch.distributed process group, or the lone
process of a job that never initialized torch.distributed (then every collective here is a no-op).

Why `settle()` ends every save and load: gloo runs collectives on its own threads. The thread that ran
one drops its reference to it a moment after the caller was told it finished; when that is the last
reference, the collective's tensors are freed on that thread, which needs the GIL. If the training script
tears the group down in that moment (`destroy_process_group()`, or a DDP module freed, right after a
save), the main thread joins gloo's threads while holding the GIL, and both wait forever (seen here in
about one run in ten). `settle()` is a last tiny collective whose work object this module keeps until the
next one: its wait releases the GIL, so the clean-up of the collectives before it completes, and its own
clean-up happens later on the caller's thread.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

T = TypeVar("T")

# One flag tensor per device, and the work of the last collective on it, kept (see the module doc).
_FLAGS: dict[str, torch.Tensor] = {}
_LAST_WORK: dict[str, Any] = {}


def _flag(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _FLAGS:
        _FLAGS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _FLAGS[key]


class Gang:
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = bool(dist.is_available() and dist.is_initialized())
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1

    def _device(self) -> torch.device | None:
        # Object collectives on an NCCL group travel through the current CUDA device.
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0, device=self._device())
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return cast(list[T], out)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank."""
        if not self.distributed or self.world_size == 1:
            return flag
        device = self._device() or torch.device("cpu")
        t = _flag(device)
        t.fill_(1 if flag else 0)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None
        work.wait()
        _LAST_WORK[str(device)] = work  # the previous one is freed here, on this thread
        return bool(t.item())

    def settle(self) -> None:
        """A last collective that leaves nothing for gloo's threads to clean up (see the module doc)."""
        self.any(False)
