"""Compile proto/ into gen/ (python modules, gRPC stubs and typed .pyi stubs).

gen/ mirrors the proto package tree (trainyard/<service>/v1), so generated imports resolve as they are.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc_tools  # type: ignore[import-untyped]
from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    proto_root = ROOT / "proto"
    out = ROOT / "gen"
    out.mkdir(exist_ok=True)
    files = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    if not files:
        print("no .proto files under proto/", file=sys.stderr)
        return 1
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    bindir = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *files,
    ]
    rc = int(protoc.main(args))
    if rc != 0:
        return rc
    # Regular packages (with __init__.py) so mypy and setuptools see one tree; "trainyard" itself
    # stays a namespace so nothing else may claim it by accident.
    for d in out.rglob("*"):
        if d.is_dir() and d != out / "trainyard" and d.name != "__pycache__":
            (d / "__init__.py").touch()
    (out / "trainyard" / "py.typed").touch()
    print(f"generated {len(files)} proto files into {out.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
