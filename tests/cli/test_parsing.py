"""Argument parsing, spec building and usage errors (exit 2); nothing here needs a gateway."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from trainyard_cli.errors import UsageError
from trainyard_cli.main import build_parser, main
from trainyard_cli.spec import build_spec, load_spec_file, parse_pairs

FLAGS = {"file_spec": None, "name": None, "command": (), "nodes": None, "gpus_per_node": None,
         "accelerator": None, "env": {}, "labels": {}, "working_dir": None, "queue": None, "priority": None,
         "max_restarts": None}


def test_submit_flags_and_command_after_double_dash() -> None:
    args = build_parser().parse_args(["submit", "--name", "hello", "--nodes", "2", "--gpus-per-node", "4",
                                      "--env", "A=1", "--env", "B=x=y", "--json", "--",
                                      "python", "train.py", "--lr", "3"])
    assert (args.name, args.nodes, args.gpus_per_node, args.env, args.json) == ("hello", 2, 4, ["A=1", "B=x=y"],
                                                                                True)
    assert args.command[-4:] == ["python", "train.py", "--lr", "3"]


def test_global_options_before_or_after_the_command() -> None:
    before = build_parser().parse_args(["--url", "http://a:1", "--json", "jobs"])
    after = build_parser().parse_args(["jobs", "--url", "http://a:1", "--json"])
    neither = build_parser().parse_args(["jobs"])
    assert (before.url, before.json) == (after.url, after.json) == ("http://a:1", True)
    assert not hasattr(neither, "url") and not hasattr(neither, "json")


def test_build_spec_merges_file_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: from-file\ncommand: [python, a.py]\nenv: {THREADS: 4, DEBUG: yes, LR: '0.1'}\n"
                    "resources: {nodes: 1, gpus_per_node: 8}\n")
    spec = build_spec(**{**FLAGS, "file_spec": load_spec_file(str(path)), "nodes": 3, "env": {"LR": "0.2"}})
    assert spec == {"name": "from-file", "command": ["python", "a.py"],
                    "env": {"THREADS": "4", "DEBUG": "true", "LR": "0.2"},
                    "resources": {"nodes": 3, "gpus_per_node": 8}}
    assert build_spec(**{**FLAGS, "name": "n", "command": ["true"]})["resources"] == {"nodes": 1, "gpus_per_node": 1}


def test_json_spec_files_and_unknown_fields_pass_through(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"name": "j", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1},
                                "surprise": 1}))
    # The gateway, not the CLI, refuses unknown fields, with a message naming them.
    assert build_spec(**{**FLAGS, "file_spec": load_spec_file(str(path))})["surprise"] == 1


@pytest.mark.parametrize(("content", "name", "message"), [
    ("name: [unclosed", "job.yaml", "is not valid YAML"),
    ("{", "job.json", "is not valid JSON"),
    ("- a\n- b\n", "job.yaml", "must hold a mapping"),
])
def test_bad_spec_files(tmp_path: Path, content: str, name: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_spec_file(str(path))


def test_env_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FROM_HERE", "copied")
    assert parse_pairs(["A=1", "B=", "FROM_HERE"], "--env", {"FROM_HERE": "copied"}) == {
        "A": "1", "B": "", "FROM_HERE": "copied"}
    with pytest.raises(UsageError, match="NOT_SET is not set"):
        parse_pairs(["NOT_SET"], "--env", {})
    with pytest.raises(UsageError, match="--label expects KEY=VALUE"):
        parse_pairs(["=x"], "--label")


async def test_usage_errors_exit_2(cli: Any, tmp_path: Path) -> None:
    r = await cli("submit", "--url", "http://127.0.0.1:9", "--token", "ty_x", "--", "python", "t.py")
    assert (r.rc, r.err.strip()) == (2, "error: a job needs a name: pass --name NAME or give `name:` in the "
                                        "spec file")
    r = await cli("submit", "--name", "x", "--url", "http://127.0.0.1:9", "--token", "ty_x")
    assert r.rc == 2 and "a job needs a command" in r.err
    r = await cli("submit", "-f", str(tmp_path / "missing.yaml"))
    assert r.rc == 2 and "cannot read spec file" in r.err
    r = await cli("jobs")
    assert r.rc == 2 and "error: no gateway URL" in r.err
    r = await cli("jobs", "--url", "http://127.0.0.1:9")
    assert r.rc == 2 and "error: no API token" in r.err
    r = await cli("submit", "--nodes", "two")
    assert r.rc == 2 and "invalid int value" in r.err
    r = await cli("jobs", "--state", "sleeping")
    assert r.rc == 2 and "invalid choice" in r.err
    r = await cli("status")
    assert r.rc == 2 and "job_id" in r.err
    r = await cli()
    assert r.rc == 2 and "COMMAND" in r.err
    r = await cli("tokens")
    assert r.rc == 2
    assert "Traceback" not in r.err


async def test_help_exits_0(cli: Any) -> None:
    r = await cli("--help")
    assert r.rc == 0
    for command in ("submit", "jobs", "status", "logs", "cancel", "nodes", "tokens", "local"):
        assert command in r.out
    r = await cli("submit", "--help")
    assert r.rc == 0 and "spec file (YAML or JSON)" in r.out


def test_local_subcommand_when_its_module_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "trainyard_cli.local", None)
    assert main(["local", "up"]) == 2
    assert "trainyard_cli.local is missing" in capsys.readouterr().err
    assert main(["--help"]) == 0  # the other commands are unaffected
