"""The reader copies each tensor straight from the verified file bytes into the state dict: bit-exact for
every dtype and layout, narrowed as resharding narrows, at any alignment; conversions and other archives
still go through torch.load; a damaged chunk never reaches the state dict."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException

from trainyard_checkpoint.client import ShardCorrupt
from trainyard_checkpoint.client import reader as reader_module
from trainyard_checkpoint.client.reader import TrainyardReader, _copy_stored, _Stored, _stored_tensor
from trainyard_checkpoint.client.service import CheckpointInfo
from trainyard_checkpoint.client.writer import TrainyardWriter

CHUNK = 4096


def save(tmp_path: Path, state: dict[str, Any]) -> CheckpointInfo:
    location = (tmp_path / "ckpt").as_uri()
    writer = TrainyardWriter(location, thread_count=2, chunk_bytes=CHUNK, sync_files=False)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return CheckpointInfo(id="c1", job_id="j", attempt=0, step=1, world_size=1, location=location,
                          state="COMMITTED", shards=tuple(writer.files),
                          total_bytes=sum(f.size_bytes for f in writer.files), manifest_path="")


def load(ckpt: CheckpointInfo, target: dict[str, Any]) -> None:
    dcp.load(target, storage_reader=TrainyardReader(ckpt, thread_count=2), no_dist=True)


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(10_000, generator=gen),  # spans several chunks
        "t": torch.randn(30, 20, generator=gen).t(),
        "bf16": torch.randn(333, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(7, 9, generator=gen).to(torch.float16),
        "f8": torch.randn(64, generator=gen).to(torch.float8_e4m3fn),
        "mask": torch.rand(101, generator=gen) > 0.5,
        "u8": torch.randint(0, 255, (55,), dtype=torch.uint8, generator=gen),
        "i64": torch.randint(-(1 << 40), 1 << 40, (13,), dtype=torch.int64, generator=gen),
        "c64": torch.randn(17, dtype=torch.complex64, generator=gen),
        "f64": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 5),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype.is_complex:
        return torch.view_as_real(t).contiguous().view(torch.int32)
    return t.contiguous().view(as_int[t.element_size()])


def test_every_dtype_and_layout_is_copied_in_place_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = state()
    copied: list[bool] = []

    def spy(stored: _Stored, target: torch.Tensor) -> bool:
        copied.append(_copy_stored(stored, target))
        return copied[-1]

    monkeypatch.setattr(reader_module, "_copy_stored", spy)
    target = {k: torch.full_like(v, 1) if v.dtype != torch.float8_e4m3fn else torch.zeros_like(v)
              for k, v in saved.items()}
    target["t"] = torch.zeros(20, 30)  # saved transposed, loaded into a contiguous tensor
    saved["t2"] = saved["t"].contiguous()
    target["t2"] = torch.zeros(30, 20).t()  # saved contiguous, loaded into a transposed tensor
    ckpt = save(tmp_path, saved)
    ids = {k: v.data_ptr() for k, v in target.items()}
    load(ckpt, target)
    for k, v in saved.items():
        assert target[k].dtype == v.dtype and target[k].shape == v.shape, k
        assert torch.equal(bits(target[k]), bits(v)), k
        assert target[k].data_ptr() == ids[k], f"{k}: loaded in place"
    assert copied and all(copied), "every plain tensor is copied without torch.load"


def test_a_dtype_conversion_goes_through_torch_load_as_stock_dcp(tmp_path: Path) -> None:
    saved = {"w": torch.randn(100), "n": torch.arange(10, dtype=torch.int32)}
    ckpt = save(tmp_path, saved)
    target = {"w": torch.zeros(100, dtype=torch.float64), "n": torch.zeros(10, dtype=torch.int64)}
    load(ckpt, target)
    assert torch.equal(target["w"], saved["w"].double()) and torch.equal(target["n"], saved["n"].long())


@pytest.mark.parametrize("shift", [0, 1, 3, 6, 64])
@pytest.mark.parametrize("source", ["contiguous", "transposed"])
def test_narrowed_pieces_at_any_alignment(shift: int, source: str) -> None:
    full = torch.randn(12, 10) if source == "contiguous" else torch.randn(10, 12).t()
    buf = io.BytesIO()
    torch.save(full, buf)
    blob = memoryview(bytes(shift) + buf.getvalue())[shift:]  # the archive at an odd address
    stored = _stored_tensor(blob)
    assert stored is not None
    for offsets, lengths in [([0, 0], [12, 10]), ([4, 0], [5, 10]), ([0, 3], [12, 4]), ([2, 7], [9, 3])]:
        piece = narrow_tensor_by_index(stored.layout, offsets, lengths)
        expected = narrow_tensor_by_index(full, offsets, lengths)
        whole = torch.full((20, 20), -1.0)
        inside = whole[3:3 + lengths[0], 5:5 + lengths[1]]  # a piece of a larger tensor, as a rank's shard
        for target in (torch.zeros(lengths), torch.zeros(lengths[::-1]).t(), inside):
            assert _copy_stored(_Stored(stored.data, piece), target)
            assert torch.equal(target, expected)
        inside.fill_(-1.0)
        assert torch.equal(whole, torch.full((20, 20), -1.0)), "nothing outside the target is written"


def test_archives_it_does_not_know_are_left_to_torch_load() -> None:
    buf = io.BytesIO()
    torch.save({"a": torch.ones(2), "b": torch.zeros(3)}, buf)  # two storages
    assert _stored_tensor(memoryview(buf.getvalue())) is None
    assert _stored_tensor(memoryview(b"not an archive")) is None
    buf = io.BytesIO()
    torch.save(torch.randn(4, 4).to_sparse(), buf)
    assert _stored_tensor(memoryview(buf.getvalue())) is None


def test_a_damaged_chunk_never_reaches_the_state_dict(tmp_path: Path) -> None:
    saved = {"big": torch.randn(20_000), "small": torch.randn(10)}
    ckpt = save(tmp_path, saved)
    meta = TrainyardReader(ckpt).read_metadata()
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "big")
    path = tmp_path / "ckpt" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF  # inside big's values
    path.write_bytes(bytes(data))
    target = {"big": torch.full((20_000,), 42.0), "small": torch.zeros(10)}
    with pytest.raises(CheckpointException) as raised:
        load(ckpt, target)
    failures = [f for f, _ in raised.value.failures.values()]
    assert any(isinstance(f, ShardCorrupt) and "differs from its checksum" in str(f) for f in failures)
    assert torch.equal(target["big"], torch.full((20_000,), 42.0)), "no byte of the damaged item was copied"


def test_a_file_of_the_wrong_size_is_refused_before_it_is_mapped(tmp_path: Path) -> None:
    ckpt = save(tmp_path, {"w": torch.randn(1000)})
    shard = next(s for s in ckpt.shards if s.path.endswith(".distcp"))
    path = tmp_path / "ckpt" / shard.path
    with open(path, "ab") as f:
        f.write(os.urandom(10))
    with pytest.raises(CheckpointException) as raised:
        load(ckpt, {"w": torch.zeros(1000)})
    assert any("expected" in str(f) for f, _ in raised.value.failures.values())
