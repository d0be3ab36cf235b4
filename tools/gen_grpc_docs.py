"""Write docs/grpc-api.md, the reference of Trainyard's gRPC API for internal tools, from proto/ and the
authorization table.

protoc (grpc_tools, the compiler `make proto` uses) compiles every .proto under proto/ into a descriptor set
with source info, so every service, method, message, field and enum value comes with the comments written
above or beside it in the .proto. Who may call each method is `trainyard_core.security.authz.RULES` (the table
every server enforces), and whether a call is recorded in the audit log is its `AUDITED`. The document is
regenerated, never edited: tests/sdk/test_grpc_docs.py fails when it differs from what this script writes.

    .venv/bin/python tools/gen_grpc_docs.py            # rewrite docs/grpc-api.md
    .venv/bin/python tools/gen_grpc_docs.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc_tools
from google.protobuf import descriptor_pb2 as d
from grpc_tools import protoc

from trainyard_core.security.authz import AUDITED, RULES

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "docs" / "grpc-api.md"
COMMAND = ".venv/bin/python tools/gen_grpc_docs.py"

# SourceCodeInfo paths (descriptor.proto's field numbers).
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
ENUM_VALUE, SERVICE_METHOD = 2, 2
SCALARS = {number: name.removeprefix("TYPE_").lower() for name, number in d.FieldDescriptorProto.Type.items()}
PRINCIPALS = {"scheduler": "the scheduler", "gateway": "the gateway", "checkpoint-store": "the checkpoint-store",
              "node": "node agents", "tool": "tools", "job": "a job's workers"}


def descriptor_set(proto_root: Path = PROTO) -> d.FileDescriptorSet:
    files = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", "--include_source_info",
                          f"--descriptor_set_out={out}", *files])
        if rc != 0:
            raise SystemExit(f"protoc failed ({rc}) on proto/")
        fds = d.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
    return fds


def _comments(file: d.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    out: dict[tuple[int, ...], str] = {}
    for loc in file.source_code_info.location:
        text = " ".join(part for part in (loc.leading_comments, loc.trailing_comments) if part.strip())
        if text.strip():
            out[tuple(loc.path)] = _one_paragraph(text)
    return out


def _one_paragraph(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def _anchor(full_name: str) -> str:
    return full_name.lower().replace(".", "")


@dataclass(frozen=True)
class Message:
    full_name: str
    proto: d.DescriptorProto
    path: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class Enum:
    full_name: str
    proto: d.EnumDescriptorProto
    path: tuple[int, ...]
    file: str


def _walk_messages(file: d.FileDescriptorProto, prefix: str, protos: Iterable[d.DescriptorProto],
                   path: tuple[int, ...]) -> Iterator[Message | Enum]:
    for i, message in enumerate(protos):
        here = (*path, i)
        name = f"{prefix}.{message.name}"
        yield Message(name, message, here, file.name)
        for j, enum in enumerate(message.enum_type):
            yield Enum(f"{name}.{enum.name}", enum, (*here, MESSAGE_ENUM, j), file.name)
        yield from _walk_messages(file, name, message.nested_type, (*here, MESSAGE_NESTED))


class Reference:
    """The whole API from a descriptor set; `render()` is the document."""

    def __init__(self, fds: d.FileDescriptorSet, rules: Mapping[str, object], audited: Mapping[str, object]) -> None:
        self.files = [f for f in fds.file if f.package.startswith("trainyard.")]
        self.rules = rules
        self.audited = audited
        self.comments = {f.name: _comments(f) for f in self.files}
        self.types: dict[str, Message | Enum] = {}
        for f in self.files:
            for item in _walk_messages(f, f".{f.package}", f.message_type, (FILE_MESSAGE,)):
                self.types[item.full_name] = item
            for i, enum in enumerate(f.enum_type):
                self.types[f".{f.package}.{enum.name}"] = Enum(f".{f.package}.{enum.name}", enum, (FILE_ENUM, i),
                                                               f.name)

    def comment(self, file: str, path: Sequence[int]) -> str:
        return self.comments[file].get(tuple(path), "")

    def type_ref(self, name: str) -> str:
        if name in self.types:
            return f"[`{name.rsplit('.', 1)[-1]}`](#{_anchor(name[1:])})"
        return f"`{name.lstrip('.')}`"

    def field_type(self, field: d.FieldDescriptorProto) -> str:
        if field.type in (d.FieldDescriptorProto.TYPE_MESSAGE, d.FieldDescriptorProto.TYPE_ENUM):
            entry = self.types.get(field.type_name)
            if isinstance(entry, Message) and entry.proto.options.map_entry:
                key, value = entry.proto.field
                return f"map<{self.field_type(key)}, {self.field_type(value)}>"
            base = self.type_ref(field.type_name)
        else:
            base = f"`{SCALARS[field.type]}`"
        if field.label == d.FieldDescriptorProto.LABEL_REPEATED:
            return f"repeated {base}"
        if field.proto3_optional:
            return f"optional {base}"
        return base

    def callers(self, method: str) -> str:
        rule = self.rules.get(method)
        if rule is None:
            return "nobody (not in the authorization table: refused)"
        kinds = sorted(getattr(rule, "allow", ()))
        text = ", ".join(PRINCIPALS.get(k, k) for k in kinds)
        if getattr(rule, "as_node", None) is not None:
            text += " (a node only for itself)"
        if getattr(rule, "as_job", None) is not None:
            text += " (bound to the job it names)"
        return text

    def packages(self) -> list[str]:
        """Packages with services first (alphabetically), the shared types (no services) after them."""
        names = {f.package for f in self.files}
        served = {f.package for f in self.files if f.service}
        return sorted(names & served) + sorted(names - served)

    def render(self) -> str:
        out = [_HEADER.format(command=COMMAND)]
        for package in self.packages():
            services = [f"[{s.name}](#{_anchor(f'{package}.{s.name}')})" for f in self.files if f.package == package
                        for s in f.service]
            out.append(f"- [{package}](#{_anchor(package)})" + (": " + ", ".join(services) if services else
                                                                 ": shared messages"))
        for package in self.packages():
            out += self._package(package, [f for f in self.files if f.package == package])
        return "\n".join(out).rstrip() + "\n"

    def _package(self, package: str, files: list[d.FileDescriptorProto]) -> list[str]:
        out = [f"\n## {package}\n"]
        for f in files:
            about = self.comment(f.name, (12,))  # a file's leading comment is attached to its `syntax` statement
            out.append(f"- `proto/{f.name}`" + (f": {about}" if about else ""))
        out.append("")
        for f in files:
            for i, service in enumerate(f.service):
                out += self._service(f, service, (FILE_SERVICE, i))
        names = {f.name for f in files}
        items = [t for t in self.types.values() if t.file in names]
        messages = [t for t in items if isinstance(t, Message) and not t.proto.options.map_entry]
        enums = [t for t in items if isinstance(t, Enum)]
        if messages:
            out.append(f"### Messages of {package}\n")
            for m in messages:
                out += self._message(m)
        if enums:
            out.append(f"### Enums of {package}\n")
            for e in enums:
                out += self._enum(e)
        return out

    def _service(self, f: d.FileDescriptorProto, service: d.ServiceDescriptorProto, path: tuple[int, ...]) -> list[str]:
        full = f"{f.package}.{service.name}"
        out = [f"### {full}\n"]
        about = self.comment(f.name, path)
        if about:
            out.append(about + "\n")
        out.append("| method | request → response | who may call it | audited | what it does |")
        out.append("|---|---|---|---|---|")
        for j, method in enumerate(service.method):
            key = f"/{full}/{method.name}"
            request = ("stream " if method.client_streaming else "") + self.type_ref(method.input_type)
            response = ("stream " if method.server_streaming else "") + self.type_ref(method.output_type)
            out.append(f"| `{method.name}` | {request} → {response} | {_cell(self.callers(key))} | "
                       f"{'yes' if key in self.audited else 'no'} | "
                       f"{_cell(self.comment(f.name, (*path, SERVICE_METHOD, j)))} |")
        return [*out, ""]

    def _message(self, m: Message) -> list[str]:
        name = m.full_name[1:]
        out = [f"#### {name}\n"]
        about = self.comment(m.file, m.path)
        if about:
            out.append(about + "\n")
        if not m.proto.field:
            return [*out, "(no fields)\n"]
        out += ["| field | number | type | about |", "|---|---|---|---|"]
        for k, field in enumerate(m.proto.field):
            note = self.comment(m.file, (*m.path, MESSAGE_FIELD, k))
            if field.HasField("oneof_index") and not field.proto3_optional:
                note = f"one of `{m.proto.oneof_decl[field.oneof_index].name}`. {note}".strip()
            out.append(f"| `{field.name}` | {field.number} | {self.field_type(field)} | {_cell(note)} |")
        return [*out, ""]

    def _enum(self, e: Enum) -> list[str]:
        out = [f"#### {e.full_name[1:]}\n"]
        about = self.comment(e.file, e.path)
        if about:
            out.append(about + "\n")
        out += ["| value | number | about |", "|---|---|---|"]
        for k, value in enumerate(e.proto.value):
            out.append(f"| `{value.name}` | {value.number} | "
                       f"{_cell(self.comment(e.file, (*e.path, ENUM_VALUE, k)))} |")
        return [*out, ""]


_HEADER = """\
# gRPC API reference

The gRPC services of Trainyard's control plane, for internal tools (the public API is the gateway's HTTP API:
README.md, "HTTP API", and its Python SDK). Generated from `proto/` and the authorization table
(`trainyard_core/security/authz.py`); do not edit it by hand. After changing either, regenerate it with

    {command}

(a test fails while this file is out of date).

Every call needs mTLS with a certificate of the deployment's CA; "who may call it" names the principals of
those certificates (`trainyard://scheduler`, `trainyard://gateway`, `trainyard://checkpoint-store`,
`trainyard://node/<id>`, `trainyard://tool/<name>`, and a job's own credential). A tool's calls on jobs are
limited to the teams the scheduler's settings bind it to; docs/security.md has the details. "Audited": the
call is recorded in the audit log. Errors are gRPC status codes with a message (NOT_FOUND, INVALID_ARGUMENT,
FAILED_PRECONDITION, PERMISSION_DENIED, UNAVAILABLE, ...).
"""


def generate(proto_root: Path = PROTO) -> str:
    return Reference(descriptor_set(proto_root), RULES, AUDITED).render()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/grpc-api.md is out of date")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date with proto/: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
