"""Staging with several copy threads: the snapshot is bit-exact for every kind of tensor, complete when
`stage` returns, and the copy plan covers every byte once."""

from __future__ import annotations

import itertools
import os
import pickle
from typing import Any

import pytest
import torch

from trainyard_checkpoint.client import staging
from trainyard_checkpoint.client.staging import Materializer, Stager, split_runs


@pytest.mark.parametrize("sizes", [[10], [1, 1, 1], [100, 3, 57, 8], [7] * 9, [1 << 20, 5]])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_split_runs_covers_every_byte_once_in_order(sizes: list[int], parts: int) -> None:
    runs, dst, src = [], 1000, 50_000
    for n in sizes:
        runs.append((dst, src, n))
        dst, src = dst + n + 64, src + n + 4096
    split = split_runs(runs, parts)
    assert 1 <= len(split) <= parts
    share = -(-sum(sizes) // parts)
    assert all(sum(n for _, _, n in part) <= share for part in split)
    pieces = list(itertools.chain.from_iterable(split))
    assert all(n > 0 for _, _, n in pieces)
    covered = [(d + i, s + i) for d, s, n in pieces for i in range(n)] if sum(sizes) < 10_000 else None
    if covered is not None:
        assert covered == [(d + i, s + i) for d, s, n in runs for i in range(n)]
    assert sum(n for _, _, n in pieces) == sum(sizes)


def test_split_runs_of_nothing_is_nothing() -> None:
    assert split_runs([], 4) == []


def mixed_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    cplx = torch.randn(64, dtype=torch.complex64, generator=gen)
    return {
        "big": torch.randn(300_000, generator=gen),
        "t": torch.randn(40, 70, generator=gen).t(),  # not contiguous: copied by Tensor.copy_
        "bf16": torch.randn(1001, generator=gen).to(torch.bfloat16),
        "mask": torch.rand(333, generator=gen) > 0.5,
        "i8": torch.randint(-128, 127, (77,), dtype=torch.int8, generator=gen),
        "conj": cplx.conj(),  # a lazy conjugate: its bytes in memory are not its value
        "neg": torch._neg_view(torch.randn(50, generator=gen)),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "slice": torch.arange(1000, dtype=torch.int64)[100:300],  # a view into a larger storage
        "nested": [{"w": torch.randn(5000, generator=gen)}, (torch.ones(3, dtype=torch.int16),)],
    }


def flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}/{k}"))
    return out


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_every_tensor_is_snapshotted_bit_exact_by_any_number_of_threads(monkeypatch: pytest.MonkeyPatch,
                                                                        threads: int) -> None:
    monkeypatch.setattr(staging, "MIN_BYTES_PER_THREAD", 1)  # split even this small state between threads
    state = mixed_state()
    expected = {k: v.clone().resolve_conj().resolve_neg() for k, v in flat(state).items()}
    stager, saver = Stager(max_threads=threads), Materializer()
    try:
        skeleton, _ = stager.stage(state)
        assert stager.arena is not None
        saver.attach(os.dup(stager.arena.fd), stager.arena.nbytes, stager.arena.generation)
        with torch.no_grad():  # training goes on once stage() returned: the snapshot must not move
            for v in flat(state).values():
                if v.numel() and v.dtype != torch.bool:
                    v.add_(1)
        built = flat(saver.build(pickle.loads(pickle.dumps(skeleton))))
        assert built.keys() == expected.keys()
        for k, v in expected.items():
            got = built[k]
            assert got.dtype == v.dtype and got.shape == v.shape, k
            assert torch.equal(got, v), k
            assert not got.is_conj() and not got.is_neg(), k
    finally:
        stager.close()
        if saver.arena is not None:
            saver.arena.close()


def test_a_reused_arena_takes_the_new_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "MIN_BYTES_PER_THREAD", 1)
    state = {"w": torch.zeros(100_000), "b": torch.zeros(10)}
    stager = Stager(max_threads=3)
    try:
        stager.stage(state)
        state["w"].fill_(7)
        state["b"].fill_(-1)
        skeleton, new = stager.stage(state)
        assert not new and stager.arena is not None
        assert torch.equal(stager.arena.view(skeleton["w"]), state["w"])
        assert torch.equal(stager.arena.view(skeleton["b"]), state["b"])
    finally:
        stager.close()
