"""docs/grpc-api.md, the gRPC reference for internal tools, is what tools/gen_grpc_docs.py writes from proto/ and
the authorization table (so it cannot drift from either); and the generator shows what a reader needs: every
method with who may call it and whether it is audited, every message's fields with their types and
comments."""

from __future__ import annotations

import difflib
import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from trainyard_core.security import authz

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    """tools/gen_grpc_docs.py as a module (tools/ is no package)."""
    if "gen_grpc_docs" in sys.modules:
        return sys.modules["gen_grpc_docs"]
    spec = importlib.util.spec_from_file_location("gen_grpc_docs", ROOT / "tools" / "gen_grpc_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_up_to_date() -> None:
    gen = _generator()
    fresh = gen.generate()
    committed = gen.OUT.read_text() if gen.OUT.exists() else ""
    if committed != fresh:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(keepends=True), fresh.splitlines(keepends=True),
                                                 "docs/grpc-api.md", "generated"))[:40])
        pytest.fail(f"docs/grpc-api.md is out of date with proto/ or trainyard_core/security/authz.py; regenerate "
                    f"it with `{gen.COMMAND}` (first lines of the difference:)\n{diff}")


def test_every_rpc_is_in_the_reference_with_its_callers() -> None:
    text = (ROOT / "docs" / "grpc-api.md").read_text()
    for method in authz.RULES:
        service, name = method.strip("/").rsplit("/", 1)
        if service.startswith("grpc."):
            continue  # health and reflection are grpc's own
        assert f"### {service}" in text and f"| `{name}` |" in text, method


def test_the_generator_shows_comments_callers_types_and_audit(tmp_path: Path) -> None:
    (tmp_path / "trainyard" / "demo" / "v1").mkdir(parents=True)
    (tmp_path / "trainyard" / "demo" / "v1" / "demo.proto").write_text(textwrap.dedent("""\
        // A demo API.
        syntax = "proto3";

        package trainyard.demo.v1;

        // Does demo things.
        service DemoService {
          // Makes a widget; idempotent.
          rpc MakeWidget(MakeWidgetRequest) returns (stream Widget);
          rpc Forgotten(MakeWidgetRequest) returns (Widget);
        }

        message MakeWidgetRequest {
          // Who asks.
          string node_id = 1;
          map<string, int32> sizes = 2;  // per part
          repeated Colour colours = 3;
          optional double weight = 4;
          oneof shape { string round = 5; string square = 6; }
        }
        message Widget { string id = 1; }

        enum Colour {
          COLOUR_UNSPECIFIED = 0;
          // Like the sky.
          COLOUR_BLUE = 1;
        }
        """))
    gen = _generator()
    rules = {"/trainyard.demo.v1.DemoService/MakeWidget": authz.rule("node", "tool", as_node=lambda r: r.node_id)}
    audited = {"/trainyard.demo.v1.DemoService/MakeWidget": object()}
    text = gen.Reference(gen.descriptor_set(tmp_path), rules, audited).render()
    assert "- `proto/trainyard/demo/v1/demo.proto`: A demo API." in text
    assert "### trainyard.demo.v1.DemoService\n\nDoes demo things." in text
    assert ("| `MakeWidget` | [`MakeWidgetRequest`](#trainyarddemov1makewidgetrequest) → stream "
            "[`Widget`](#trainyarddemov1widget) | node agents, tools (a node only for itself) | yes | "
            "Makes a widget; idempotent. |") in text
    assert "| `Forgotten` |" in text and "nobody (not in the authorization table: refused) | no |" in text
    assert "| `node_id` | 1 | `string` | Who asks. |" in text
    assert "| `sizes` | 2 | map<`string`, `int32`> | per part |" in text
    assert "| `colours` | 3 | repeated [`Colour`](#trainyarddemov1colour) |" in text
    assert "| `weight` | 4 | optional `double` |" in text
    assert "| `square` | 6 | `string` | one of `shape`. |" in text
    assert "| `COLOUR_BLUE` | 1 | Like the sky. |" in text
    assert "SizesEntry" not in text  # a map's entry type is the map, not a message of its own
