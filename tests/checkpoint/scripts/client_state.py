"""The deterministic training state the client tests save and load: the same step gives the same bytes in
any process, so a loader can check what it got bit for bit without having seen the saver.

Global shapes are fixed; how they are split depends on the world size of the job that holds them: with a
process group the sharded entries are DTensors (Shard(0) / Shard(1) over a 1-D CPU mesh), without one
they are plain tensors. Uneven splits on purpose (10 rows over 3 ranks, 4 columns over 3 ranks).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

SHARDED = {"model.w": ((10, 6), torch.float32, 0), "model.emb": ((9, 4), torch.float32, 1),
           "model.big": ((64, 64), torch.float32, 0)}
REPLICATED = {"model.b": ((7,), torch.bfloat16), "optim.count": ((3,), torch.int64)}


def global_tensor(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash_seed(name, step))
    if name in SHARDED:
        shape, dtype, _ = SHARDED[name]
    else:
        shape, dtype = REPLICATED[name]
    if dtype == torch.int64:
        return torch.randint(0, 1 << 40, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


def hash_seed(name: str, step: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}/{step}".encode()).digest()[:6], "little")


def _mesh(world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def build(step: int, *, distributed: bool, world_size: int, empty: bool = False) -> dict[str, Any]:
    """The nested state dict of `step` (zeros of the same layout when `empty`, to load into)."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    mesh = _mesh(world_size) if distributed else None
    for name in [*SHARDED, *REPLICATED]:
        full = global_tensor(name, step)
        if empty:
            full = torch.zeros_like(full)
        if mesh is not None and name in SHARDED:
            from torch.distributed.tensor import Shard, distribute_tensor

            value: Any = distribute_tensor(full, mesh, [Shard(SHARDED[name][2])])
        else:
            value = full
        group, key = name.split(".")
        (model if group == "model" else optim)[key] = value
    extra = {"step": -1 if empty else step, "note": "" if empty else f"state of step {step}"}
    return {"model": model, "optim": optim, "extra": extra}


def full(value: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def mismatches(state: dict[str, Any], step: int) -> list[str]:
    """What differs from the state of `step`, bit for bit (empty: identical)."""
    problems = []
    for name in [*SHARDED, *REPLICATED]:
        group, key = name.split(".")
        got = full(state[group][key])
        want = global_tensor(name, step)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            problems.append(f"{name} differs from step {step}")
    if state["extra"] != {"step": step, "note": f"state of step {step}"}:
        problems.append(f"extra is {state['extra']!r}")
    return problems


def digests(step: int) -> dict[str, str]:
    """sha256 of each global tensor's bytes: what a reader that knows nothing of this module compares."""
    out = {}
    for name in [*SHARDED, *REPLICATED]:
        t = global_tensor(name, step).contiguous()
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out
