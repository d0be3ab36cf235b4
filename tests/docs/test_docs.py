"""The documentation says what the code does: its JSON and YAML blocks parse and are accepted by the real
schemas and settings loaders, every command line it shows uses flags the program has, every
`TRAINYARD_*` variable it names is read by something, the accelerator names it uses are those agents
report, and what it says about metrics holds.

Documents: README.md, deploy/README.md, docs/*.md, services/*/README.md (see markdown.py). A block or
command these tests cannot place fails with where it is, so a new example is checked too, not skipped.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from trainyard_agent import cli as agent_cli
from trainyard_agent.health.policy import policy_from_data
from trainyard_agent.model import normalise_model
from trainyard_agent.nvml.profiles import PROFILES
from trainyard_agent.settings import AgentSettings
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_cli.main import build_parser
from trainyard_core.settings import BaseSettings, env_names, load_settings, settings_parser
from trainyard_gateway.schemas.jobs import JobSubmit
from trainyard_gateway.settings import GatewaySettings
from trainyard_scheduler.settings import SchedulerSettings

from .markdown import ENV_NAME, ROOT, Block, Doc, commands, doc_files, flags_of, read_doc

SERVICES: dict[str, type[BaseSettings]] = {
    "trainyard-scheduler": SchedulerSettings,
    "trainyard-checkpoint-store": CheckpointSettings,
    "trainyard-gateway": GatewaySettings,
    "trainyard-agent": AgentSettings,
}
DOCS = [read_doc(p) for p in doc_files()]
STRUCTURED = ("json", "yaml")
SHELL = ("sh", "bash", "console", "")


def _id(doc: Doc) -> str:
    return str(doc.path.relative_to(ROOT))


def _blocks(*langs: str) -> list[Block]:
    return [b for d in DOCS for b in d.blocks if b.lang in langs]


# --- (a) JSON and YAML blocks ------------------------------------------------------------------------------

def test_the_documents_are_found() -> None:
    names = {_id(d) for d in DOCS}
    assert {"README.md", "deploy/README.md", "docs/operations.md", "services/node-agent/README.md"} <= names
    assert _blocks("json") and _blocks("yaml")


def test_structured_blocks_are_marked_json_or_yaml() -> None:
    """jsonc, json5, yml: a reader's tool (and these tests) would treat them differently."""
    odd = [b.where for d in DOCS for b in d.blocks if b.lang.lower() in ("jsonc", "json5", "yml", "js")]
    assert not odd, f"mark these blocks json (valid JSON, no comments) or yaml: {odd}"


@pytest.mark.parametrize("block", _blocks("json"), ids=lambda b: b.where)
def test_json_blocks_are_valid_json(block: Block) -> None:
    try:
        json.loads(block.text)
    except json.JSONDecodeError as e:
        pytest.fail(f"{block.where}: not valid JSON ({e}); move comments into the prose")


@pytest.mark.parametrize("block", _blocks("yaml"), ids=lambda b: b.where)
def test_yaml_blocks_load(block: Block) -> None:
    try:
        yaml.safe_load(block.text)
    except yaml.YAMLError as e:
        pytest.fail(f"{block.where}: not valid YAML ({e})")


def _settings_classes_for(keys: set[str]) -> list[type[BaseSettings]]:
    return [cls for cls in SERVICES.values() if keys <= set(cls.model_fields)]


def _validator(block: Block, data: Any, tmp_path: Path) -> Callable[[], object]:
    """What the block is (a job spec, a service's settings file, a health policy file) as the function
    that loads it the way the real program would."""
    if not isinstance(data, dict):
        pytest.fail(f"{block.where}: a {block.lang} block that is no mapping; tests/docs/test_docs.py cannot "
                    "tell what it is")
    keys = {str(k) for k in data}
    if {"name", "command", "resources"} <= keys:
        return lambda: JobSubmit.model_validate(data)  # the gateway's POST /v1/jobs body
    if keys <= {"xids", "unknown_xid", "thresholds"}:
        return lambda: policy_from_data(data, block.where)  # the agent's --health-policy-file
    classes = _settings_classes_for(keys)
    if classes:
        path = tmp_path / "settings.yaml"
        path.write_text(yaml.safe_dump(data))
        return lambda: [load_settings(cls, prog=block.where, argv=["--config", str(path)], env={})
                        for cls in classes]
    pytest.fail(f"{block.where}: neither a job spec, a health policy nor the settings of one service (keys "
                f"{sorted(keys)}); teach tests/docs/test_docs.py what it is")


@pytest.mark.parametrize("block", _blocks(*STRUCTURED), ids=lambda b: b.where)
def test_structured_blocks_are_accepted_by_the_real_loader(block: Block, tmp_path: Path) -> None:
    data = json.loads(block.text) if block.lang == "json" else yaml.safe_load(block.text)
    load = _validator(block, data, tmp_path)
    try:
        load()
    except Exception as e:  # the message is the finding
        pytest.fail(f"{block.where}: refused by the real loader: {e}")


# --- (b) command lines and flags --------------------------------------------------------------------------

def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(parser: argparse.ArgumentParser, words: list[str]) -> set[str]:
    """The options of the (sub)command `words` names, with those of the commands above it."""
    accepted = _options(parser)
    for word in words:
        sub = _subcommands(parser).get(word)
        if sub is None:
            break
        parser = sub
        accepted |= _options(parser)
    return accepted


def _all_options(parser: argparse.ArgumentParser) -> set[str]:
    return _options(parser).union(*(_all_options(p) for p in _subcommands(parser).values()))


def accepted_flags(argv: list[str]) -> set[str] | None:
    """The long options the Trainyard program in argv[0] accepts there; None for other programs."""
    prog = Path(argv[0]).name
    words = [w for w in argv[1:] if not w.startswith("-")]
    if prog == "trainyard":
        return _walk(build_parser(), words)
    if prog == "trainyard-agent" and argv[1:2] and argv[1] in agent_cli.COMMANDS:
        return _walk(agent_cli._parser(), words)
    if prog in SERVICES:
        return _options(settings_parser(SERVICES[prog], prog=prog))
    return None


def every_trainyard_flag() -> set[str]:
    parsers = [build_parser(), agent_cli._parser(), *(settings_parser(c, prog=p) for p, c in SERVICES.items())]
    return set().union(*(_all_options(p) for p in parsers))


def documented_commands(doc: Doc) -> Iterator[tuple[str, list[str]]]:
    """(where, argv) of every command line: in shell blocks and in inline code."""
    for block in doc.blocks:
        if block.lang in SHELL:
            for argv in commands(block.text, comments=True):
                yield block.where, argv
    for span in doc.inline_code:
        for argv in commands(span, comments=False):
            yield f"{_id(doc)} `{span}`", argv


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_documented_command_lines_use_flags_the_program_has(doc: Doc) -> None:
    known = every_trainyard_flag()
    wrong = []
    for where, argv in documented_commands(doc):
        if argv[0].startswith("--"):  # a flag on its own in the prose: some Trainyard program's
            wrong += [f"{where}: {f}" for f in flags_of(["", *argv]) if f not in known]
            continue
        accepted = accepted_flags(argv)
        if accepted is not None:
            wrong += [f"{where}: {Path(argv[0]).name} has no {f}" for f in flags_of(argv) if f not in accepted]
    assert not wrong, "documented flags the programs refuse:\n" + "\n".join(wrong)


_PLACEHOLDER = re.compile(r"\b[A-Z]{1,}\b")  # NAME, VALUE, FILE, N: a syntax line, not a command


def _service_runs(doc: Doc) -> Iterator[tuple[str, str, list[str]]]:
    """(where, program, arguments) of each service command line in `doc`: those naming the program, and
    flags shown on their own with values (`--gpu-profile h100x8`), for every service that has them all."""
    for where, argv in documented_commands(doc):
        prog = Path(argv[0]).name
        if prog in SERVICES and len(argv) > 1 and "--help" not in argv and argv[1] not in agent_cli.COMMANDS:
            yield where, prog, argv[1:]
        elif argv[0].startswith("--") and any(not a.startswith("--") for a in argv) and \
                not any(_PLACEHOLDER.search(a) for a in argv):
            for prog, cls in SERVICES.items():
                if set(flags_of(["", *argv])) <= _options(settings_parser(cls, prog=prog)):
                    yield where, prog, argv


def test_documented_service_command_lines_load() -> None:
    """The service command lines the docs show, run through the real settings loader (placeholders such as
    `...` and $(hostname -f) stand in for values)."""
    tried, failed = set(), []
    for doc in DOCS:
        for where, prog, args in _service_runs(doc):
            tried.add(prog)
            try:
                load_settings(SERVICES[prog], prog=prog, argv=args, env={})
            except (Exception, SystemExit) as e:  # the message is the finding
                failed.append(f"{where} as {prog}: {e}")
    assert tried == set(SERVICES), "the README's 'Running the services on real hosts' shows every service"
    assert not failed, "\n".join(failed)


# --- environment variables ---------------------------------------------------------------------------------

def _code_variable_names() -> set[str]:
    """TRAINYARD_* names the code reads or sets as string literals (workers' and the CLI's variables)."""
    names: set[str] = set()
    for path in [*ROOT.glob("services/*/trainyard_*/**/*.py"), *ROOT.glob("libs/**/*.py")]:
        names |= set(re.findall(r"[\"'](TRAINYARD_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    return names


def _setting_variables() -> dict[str, str]:
    """Every setting's variable → the program it belongs to."""
    return {var: prog for prog, cls in SERVICES.items() for var in env_names(cls)}


def _legacy_variables() -> dict[str, str]:
    """Old names still honoured → the current name."""
    out = {}
    for cls in SERVICES.values():
        for legacy in cls.legacy_env_prefixes:
            for var in env_names(cls):
                out[legacy + var.removeprefix(cls.env_prefix)] = var
    return out


def _deploy_files() -> list[Path]:
    return sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file() and p.suffix != ".md")


@pytest.mark.parametrize("path", [*doc_files(), *_deploy_files()], ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_variables_are_read_by_something(path: Path) -> None:
    prefixes = {cls.env_prefix for cls in SERVICES.values()}
    legacy_prefixes = {p for cls in SERVICES.values() for p in cls.legacy_env_prefixes}
    settings, legacy, code = _setting_variables(), _legacy_variables(), _code_variable_names()
    wrong = []
    for name in sorted(set(ENV_NAME.findall(path.read_text()))):
        if name.endswith("_"):  # a prefix, as in TRAINYARD_SCHEDULER_<SETTING> or TRAINYARD_AGENT_*
            if name not in prefixes | legacy_prefixes | {"TRAINYARD_"}:
                wrong.append(f"{name}: no service has this prefix ({', '.join(sorted(prefixes))})")
        elif any(name.startswith(p) for p in prefixes):
            if name not in settings:
                wrong.append(f"{name}: no setting of the service of that prefix")
        elif name in legacy:
            wrong.append(f"{name}: the old name of {legacy[name]}; document the current one")
        elif name not in code:
            wrong.append(f"{name}: no code reads or sets it")
    assert not wrong, f"{path.relative_to(ROOT)}:\n" + "\n".join(wrong)


_ASSIGNMENT = re.compile(r"\b(TRAINYARD_[A-Z0-9_]+)=('[^']*'|\"[^\"]*\"|[^\s`]+)")


def test_documented_variable_assignments_load() -> None:
    """`TRAINYARD_<SERVICE>_<SETTING>=value` as the docs write it, given to the service's loader alone."""
    tried, failed = 0, []
    settings = _setting_variables()
    for doc in DOCS:
        text = "\n".join([*doc.inline_code, *(b.text for b in doc.blocks if b.lang in SHELL)])
        for name, raw in _ASSIGNMENT.findall(text):
            value = shlex.split(raw)[0] if raw[0] in "'\"" else raw
            if name not in settings or "<" in value or "..." in value:
                continue
            tried += 1
            prog = settings[name]
            try:
                load_settings(SERVICES[prog], prog=prog, env={name: value})
            except Exception as e:  # the message is the finding
                failed.append(f"{_id(doc)}: {name}={raw}: {e}")
    assert tried, "the README shows TRAINYARD_SCHEDULER_PRIORITY_CLASSES=..."
    assert not failed, "\n".join(failed)


def test_worker_and_cli_variables_cannot_be_taken_for_settings() -> None:
    """The services refuse unknown names under their prefix, so no other variable may live under one: a
    worker's environment (TRAINYARD_CHECKPOINT_STORE, the store's address) can reach a service's."""
    settings = _setting_variables()
    others = {n for n in _code_variable_names() if n not in settings}
    assert {"TRAINYARD_CHECKPOINT_STORE", "TRAINYARD_CHECKPOINT_KEEP_LAST", "TRAINYARD_URL"} <= others
    prefixes = [cls.env_prefix for cls in SERVICES.values()]
    assert not [n for n in others if any(n.startswith(p) for p in prefixes)]
    assert not set(_legacy_variables()) & others, "an old settings name is now a worker's variable"


# --- accelerator names, metrics -----------------------------------------------------------------------------

_MODEL = re.compile(r"\b(?:[ABH][0-9]{3}|L40S?|L4|Instinct|MI[0-9]{3}X?)-[A-Za-z0-9-]*[A-Za-z0-9]")


def _help_texts(parser: argparse.ArgumentParser) -> list[str]:
    return [parser.format_help(), *(t for p in _subcommands(parser).values() for t in _help_texts(p))]


def _schema_texts() -> list[str]:
    out = []
    for name in ("jobs", "quotas", "queues", "nodes"):
        module = importlib.import_module(f"trainyard_gateway.schemas.{name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__ == module.__name__:
                out.append(json.dumps(cls.model_json_schema()))
    return out


def test_accelerator_names_are_the_ones_agents_report() -> None:
    """Agents report NVML's name without the vendor, spaces as dashes (H100-80GB-HBM3); a job or quota
    naming another spelling never matches a GPU."""
    reported = {normalise_model(p.device_name) for p in PROFILES.values() if p.device_name}
    sources = {_id(d): d.path.read_text() for d in DOCS}
    sources |= {"trainyard --help": "\n".join(_help_texts(build_parser())),
                "OpenAPI schemas": "\n".join(_schema_texts()),
                **{f"{p} --help": settings_parser(c, prog=p).format_help() for p, c in SERVICES.items()},
                **{str(p.relative_to(ROOT)): p.read_text() for p in ROOT.glob("proto/**/*.proto")},
                **{str(p.relative_to(ROOT)): p.read_text() for p in _deploy_files()}}
    wrong = sorted({f"{where}: {m}" for where, text in sources.items() for m in _MODEL.findall(text)
                    if m not in reported})
    assert not wrong, f"accelerator names no agent reports (they report {sorted(reported)}):\n" + "\n".join(wrong)


def test_every_service_has_a_metrics_port_that_is_off_by_default() -> None:
    for prog, cls in SERVICES.items():
        assert "--metrics-port" in _options(settings_parser(cls, prog=prog))
        assert load_settings(cls, prog=prog, argv=["--state-dir", "/tmp/unused"] if cls is AgentSettings
                             else [], env={}).metrics_port == -1


_METRICS_PROBE = """
import json, importlib, prometheus_client
seen = {m.name for m in prometheus_client.REGISTRY.collect()}
out = {}
for module in ("trainyard_gateway.main", "trainyard_checkpoint.main", "trainyard_scheduler.main",
               "trainyard_agent.main"):
    importlib.import_module(module)
    now = {m.name for m in prometheus_client.REGISTRY.collect()}
    out[module] = sorted(now - seen)
    seen = now
print(json.dumps(out))
"""


SHARED_METRIC_PREFIXES = ("trainyard_audit_", "trainyard_rpc_", "grpc_server_")


def test_the_metrics_table_says_what_each_service_exports() -> None:
    """deploy/README.md's table: `trainyard_<x>_*` (and the agent's `DCGM_FI_DEV_*`) for those that have
    metrics, "none of its own" for the others. Each service's main module is imported in a fresh interpreter,
    in an order where a service that pulled in another's metrics would show them as its own."""
    done = subprocess.run([sys.executable, "-c", _METRICS_PROBE], capture_output=True, text=True, timeout=120,
                          check=True)
    exported = {k.split(".")[0]: v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    module = {"scheduler": "trainyard_scheduler", "node agent": "trainyard_agent",
              "checkpoint-store": "trainyard_checkpoint", "gateway": "trainyard_gateway"}
    text = (ROOT / "deploy" / "README.md").read_text().split("## Metrics", 1)[1]
    rows: dict[str, str] = {}
    for m in re.finditer(r"^\| ([a-z -]+) \| (.+) \|$", text, re.M):
        if m.group(1) in module or m.group(1) == "every service":  # "every service" may have several rows
            rows[m.group(1)] = rows.get(m.group(1), "") + m.group(2)
    # Metrics of the shared library (trainyard_core), exported by every service: their own rows (a counter
    # named with its _total, a histogram as it is).
    shared = {n for names in exported.values() for n in names if n.startswith(SHARED_METRIC_PREFIXES)}
    every = rows.get("every service", "")
    assert shared and all(f"`{n}_total" in every or f"`{n}`" in every for n in shared), shared
    rows.pop("every service", None)
    assert set(rows) == set(module)
    for service, says in rows.items():
        names = [n for n in exported[module[service]] if n not in shared]
        if "none of its own" in says:
            assert not names, f"{service} exports {names}; deploy/README.md says it has none of its own"
        else:
            prefixes = tuple(re.findall(r"`((?:trainyard_[a-z]+|DCGM_FI_DEV)_)\*`", says))
            assert prefixes and names and all(n.startswith(prefixes) for n in names), (service, names)
