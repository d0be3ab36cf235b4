"""Read a Trainyard checkpoint with nothing but stock PyTorch: `torch.distributed.checkpoint.load` and a
plain `FileSystemReader` on the checkpoint's directory. No Trainyard import is needed or used.

    python examples/read_with_plain_dcp.py /var/lib/trainyard/checkpoints/<job>/<checkpoint-id>

The checkpoint's location comes from `trainyard` (the checkpoint record) or the job's logs. This script
builds an empty state dict from the checkpoint's own `.metadata` (so it needs no model code), loads every
entry into it in a single process, and prints each tensor's shape, dtype and SHA-256 (`--json` for a
machine-readable answer). To load into a model instead, pass `model.state_dict()` (or
`{"model": model.state_dict(), ...}`, the structure the training script saved) to `dcp.load`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata


def empty_state_dict(reader: FileSystemReader) -> dict[str, Any]:
    """One entry per saved item, in the flat `a.b.c` form DCP stores: tensors of the saved global shape,
    a placeholder for other objects (DCP replaces it with the saved value)."""
    state: dict[str, Any] = {}
    for fqn, item in reader.read_metadata().state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            state[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            state[fqn] = None
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the checkpoint directory (its file:// location)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    args = parser.parse_args()

    reader = FileSystemReader(args.path)
    state = empty_state_dict(reader)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(args.path), no_dist=True)

    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    digests = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
               for k, v in tensors.items()}
    objects = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    if args.json:
        json.dump({"digests": digests, "objects": objects,
                   "trainyard_importable": importlib.util.find_spec("trainyard_checkpoint") is not None},
                  sys.stdout, default=repr)
        return 0
    for name, t in sorted(tensors.items()):
        print(f"{name:40s} {tuple(t.shape)!s:16s} {t.dtype!s:16s} {digests[name][:16]}")
    for name, value in sorted(objects.items()):
        print(f"{name:40s} {value!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
