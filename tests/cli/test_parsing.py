"""Argument parsing, spec building and usage errors (exit 2); nothing here needs a gateway."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from trainyard_cli.commands import _submit_overrides
from trainyard_cli.errors import UsageError
from trainyard_cli.main import build_parser, main
from trainyard_cli.spec import build_spec, load_spec_file, parse_duration, parse_limits, parse_pairs

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


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90.0), ("2.5", 2.5), ("45s", 45.0), ("10m", 600.0), ("1h30m", 5400.0), ("2d", 172800.0),
    ("1.5h", 5400.0), ("1d2h3m4s", 93784.0), (" 1H ", 3600.0),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1x", "1h 30m", "-1m", "ten", "1h-30m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration like"):
        parse_duration(text)


def test_quota_limits() -> None:
    assert parse_limits(["H100-80GB-HBM3=64:32", "*=8", "A100=0:0"]) == {
        "H100-80GB-HBM3": {"nominal": 64, "borrow_limit": 32}, "*": {"nominal": 8},
        "A100": {"nominal": 0, "borrow_limit": 0}}
    for bad in ("H100", "=8", "H100=x", "H100=8:y", "H100=8:"):
        if bad == "H100=8:":
            assert parse_limits([bad]) == {"H100": {"nominal": 8}}  # an empty borrow part: no limit
            continue
        with pytest.raises(UsageError, match="--limit expects MODEL=NOMINAL"):
            parse_limits([bad])


def test_new_submit_flags_build_the_spec() -> None:
    args = build_parser().parse_args([
        "submit", "--name", "big", "--nodes", "4", "--gpus-per-node", "8",
        "--accelerators", "H100-80GB-HBM3, A100-SXM4-80GB", "--min-memory-gb", "40", "--min-cc", "8.0",
        "--vendor", "nvidia", "--allow-mixed", "--cpus-per-node", "16", "--speed-hint", "H100-80GB-HBM3=2.5",
        "--priority-class", "high", "--topology-tier", "leaf", "--topology-wait", "10m",
        "--preempt-signal", "usr1", "--preempt-grace", "2m", "--restart-backoff", "0", "--time-limit", "1h30m",
        "--checkpoint-every", "500", "--checkpoint-interval", "30m", "--keep-last", "3", "--", "python", "train.py"])
    spec = build_spec(**{**FLAGS, "name": args.name, "command": args.command[1:], "nodes": args.nodes,
                         "gpus_per_node": args.gpus_per_node, "overrides": _submit_overrides(args)})
    assert spec == {
        "name": "big", "command": ["python", "train.py"],
        "resources": {"nodes": 4, "gpus_per_node": 8, "accelerators": ["H100-80GB-HBM3", "A100-SXM4-80GB"],
                      "min_memory_gb": 40, "min_compute_capability": "8.0", "vendor": "nvidia",
                      "allow_mixed": True, "cpus_per_node": 16, "speed_hints": {"H100-80GB-HBM3": 2.5}},
        "priority_class": "high", "topology": {"tier": "leaf", "wait_s": 600.0},
        "preemption": {"signal": "SIGUSR1", "grace_s": 120.0}, "restart_backoff_s": 0.0, "time_limit_s": 5400.0,
        "checkpoint": {"every_steps": 500, "interval_s": 1800.0, "keep_last": 3}}
    plain = build_parser().parse_args(["submit", "--name", "n", "--", "true"])
    assert build_spec(**{**FLAGS, "name": "n", "command": ["true"], "overrides": _submit_overrides(plain)}) == {
        "name": "n", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}  # nothing else sent


def test_spec_file_durations_and_flags_merge_into_nested_fields(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: f\ncommand: [x]\nresources: {nodes: 1, gpus_per_node: 0}\n"
                    "topology: {tier: zone, wait_s: 1h}\npreemption: {signal: SIGUSR2, grace_s: 90s}\n"
                    "time_limit_s: 2d\nrestart_backoff_s: 30\n")
    spec = build_spec(**{**FLAGS, "file_spec": load_spec_file(str(path)),
                         "overrides": {"topology.required": True, "resources.cpus_per_node": 4}})
    assert spec["topology"] == {"tier": "zone", "wait_s": 3600.0, "required": True}
    assert spec["preemption"] == {"signal": "SIGUSR2", "grace_s": 90.0}
    assert (spec["time_limit_s"], spec["restart_backoff_s"]) == (172800.0, 30)
    assert spec["resources"] == {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 4}
    path.write_text("name: f\ncommand: [x]\ntime_limit_s: soon\n")
    with pytest.raises(UsageError, match="time_limit_s in the spec file: expected seconds or a duration"):
        build_spec(**{**FLAGS, "file_spec": load_spec_file(str(path))})
    path.write_text("name: f\ncommand: [x]\ntopology: leaf\n")
    with pytest.raises(UsageError, match="topology in the spec file must be a mapping"):
        build_spec(**{**FLAGS, "file_spec": load_spec_file(str(path)), "overrides": {"topology.required": True}})


async def test_new_usage_errors_exit_2(cli: Any) -> None:
    for argv, needle in [
        (("submit", "--name", "x", "--time-limit", "soon", "--", "true"), "--time-limit: expected seconds"),
        (("submit", "--name", "x", "--topology-tier", "rack", "--", "true"), "invalid choice: 'rack'"),
        (("submit", "--name", "x", "--preempt-signal", "KILL", "--", "true"), "invalid choice: 'SIGKILL'"),
        (("submit", "--name", "x", "--min-memory-gb", "lots", "--", "true"), "invalid int value"),
        (("submit", "--name", "x", "--speed-hint", "H100", "--url", "http://127.0.0.1:9", "--token", "t",
          "--", "true"), "--speed-hint expects MODEL=FACTOR"),
        (("quotas", "set", "vision", "--limit", "H100", "--url", "http://127.0.0.1:9", "--token", "t"),
         "--limit expects MODEL=NOMINAL"),
        (("queues", "set", "batch", "--node-label", "=x", "--url", "http://127.0.0.1:9", "--token", "t"),
         "--node-label expects KEY=VALUE"),
        (("queues", "delete"), "name"),
        (("quotas", "get"), "team"),
    ]:
        r = await cli(*argv)
        assert r.rc == 2 and needle in r.err, (argv, r.err)
        assert "Traceback" not in r.err


async def test_help_lists_the_policy_commands(cli: Any) -> None:
    r = await cli("--help")
    assert "queues" in r.out and "quotas" in r.out
    r = await cli("quotas", "--help")
    assert r.rc == 0 and "MODEL=NOMINAL[:BORROW_LIMIT]" in r.out


def test_job_details_show_infrastructure_restarts() -> None:
    import io

    from trainyard_cli.output import job_details

    job = {"id": "job-1", "name": "n", "state": "running", "attempt": 3, "team": "t", "user": "u",
           "spec": {"command": ["python"], "resources": {"nodes": 2, "gpus_per_node": 1}, "max_restarts": 2},
           "restarts": 1, "infra_restarts": 1, "created_at": "2026-11-29T10:00:00Z",
           "events": [{"at": "2026-11-29T10:01:00Z", "kind": "restarting",
                       "message": "node node-2 lost contact; infrastructure failure 1"}]}
    out = io.StringIO()
    job_details(job, out)
    text = out.getvalue()
    assert "restarts" in text and "1 of 2" in text
    assert "infra restarts" in text and "not counted against max_restarts" in text
    assert "node node-2 lost contact" in text


def _subcommand(name: str) -> Any:
    sub = next(a for a in build_parser()._actions if a.dest == "command_name")
    return sub.choices[name]  # type: ignore[index]


def _choices(command: str, dest: str) -> list[str]:
    """The choices of one option of a sub-command, as argparse holds them."""
    return list(next(a for a in _subcommand(command)._actions if a.dest == dest).choices)


def test_the_clis_vocabulary_is_the_contracts() -> None:
    """What the CLI offers is what the gateway's schema and the scheduler take: one vocabulary
    (trainyard_core.contract), so a choice here can never be refused there for its spelling."""
    from trainyard_core import contract

    assert _choices("jobs", "state") == list(contract.JOB_STATES)
    assert _choices("submit", "topology_tier") == list(contract.TOPOLOGY_TIERS)
    assert _choices("submit", "preempt_signal") == list(contract.PREEMPTION_SIGNALS)
    text = " ".join(_subcommand("submit").format_help().split())
    assert f"1-{contract.MAX_NODES}" in text and f"0-{contract.MAX_GPUS_PER_NODE}" in text
    assert f"{contract.MIN_PRIORITY}..{contract.MAX_PRIORITY}" in text and f"0-{contract.MAX_RESTARTS}" in text
