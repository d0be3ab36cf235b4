"""deploy/prometheus and deploy/grafana hold what a site plugs into its own Prometheus and Grafana, and they agree
with the services: promtool (Debian's `prometheus` package, tools/sysdeps.sh) accepts the scrape configuration
and the rules, the rules' unit tests (deploy/prometheus/tests/) fire each alert above its threshold and not
below, every metric the rules and the dashboard query is one a service exports, the scrape jobs reach the
metrics ports of deploy/config/, and the dashboard imports: ids unique, a data source and a query on every
panel, every query valid PromQL.

Metric names are collected the way the services register them: their main modules are imported in a fresh
interpreter and prometheus_client's registry lists every family, whether or not it has a sample yet. Only
etcd's own series and Prometheus' `up` come from fixed lists; the etcd names are checked against the etcd the
tests run, started with the metrics listener deploy/prometheus/prometheus.yml tells operators to open.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from trainyard_core.testing import etcd as etcd_proc
from trainyard_core.testing.metrics import Scrape
from trainyard_core.testing.wait import until

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
SCRAPE_CONFIG = PROMETHEUS / "prometheus.yml"
RULES = PROMETHEUS / "alerts.yml"
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "trainyard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
CONFIGS = ROOT / "deploy" / "config"

# The scrape job of each service, and its example settings file (whose metrics_port the targets must use).
SCRAPE_JOBS = {"trainyard-scheduler": "scheduler", "trainyard-agent": "agent",
               "trainyard-checkpoint-store": "checkpoint-store", "trainyard-gateway": "gateway"}
ETCD_JOB = "etcd"
# The label prometheus.yml gives the agent's own `job` label (the Trainyard job holding a GPU).
TRAINYARD_JOB_LABEL = "trainyard_job"
SEVERITIES = {"critical", "warning", "info"}

# Series Prometheus adds to every target itself.
PROMETHEUS_SERIES = {"up"}
# etcd's own series the rules and the dashboard use, as etcd 3.4 and 3.5 name them (not importable from
# Python: test_the_etcd_series_are_what_etcd_exports scrapes the tests' etcd for them).
ETCD_SERIES = {"etcd_mvcc_db_total_size_in_bytes", "etcd_server_quota_backend_bytes", "etcd_server_has_leader"}

_EXPORTED_PROBE = """
import importlib, json, prometheus_client
for module in ("trainyard_scheduler.main", "trainyard_agent.main", "trainyard_checkpoint.main",
               "trainyard_gateway.main"):
    importlib.import_module(module)
suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"),
            "summary": ("", "_count", "_sum"), "info": ("_info",), "stateset": ("",), "unknown": ("",)}
names = sorted({family.name + s for family in prometheus_client.REGISTRY.collect() for s in suffixes[family.type]})
print(json.dumps(names))
"""


# --- promtool --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `bash tools/sysdeps.sh test` installs Debian's prometheus package, which has it"
    return path


def run_promtool(promtool: str, *args: str | Path) -> str:
    done = subprocess.run([promtool, *map(str, args)], capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{output}"
    return output


def test_promtool_accepts_the_scrape_configuration_with_its_rules_and_targets(promtool: str) -> None:
    """`check config` reads the rule files and the file_sd target files too; a target file that matched nothing
    would only be a warning."""
    output = run_promtool(promtool, "check", "config", "--lint=all", SCRAPE_CONFIG)
    assert "WARNING" not in output, output
    assert f"SUCCESS: {_rule_count()} rules found" in output, output


def test_promtool_accepts_the_rules(promtool: str) -> None:
    run_promtool(promtool, "check", "rules", "--lint=all", "--lint-fatal", RULES)


def test_the_rules_unit_tests_pass(promtool: str) -> None:
    assert RULE_TESTS, "deploy/prometheus/tests/ holds the rules' unit tests"
    output = run_promtool(promtool, "test", "rules", *RULE_TESTS)
    assert output.count("SUCCESS") == len(RULE_TESTS), output


def test_the_unit_tests_catch_a_rule_that_fires_too_early(promtool: str, tmp_path: Path) -> None:
    """The unit tests hold the thresholds: a queue-wait alert at half an hour instead of an hour fails them."""
    copy = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, copy)
    rules = copy / "alerts.yml"
    text = rules.read_text()
    assert text.count("> 3600") == 1
    rules.write_text(text.replace("> 3600", "> 1800"))
    done = subprocess.run([promtool, "test", "rules", str(copy / "tests" / "scheduling_test.yml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "TrainyardQueueWaitHigh" in done.stdout + done.stderr


def test_the_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Each panel's query and each variable's selector, with Grafana's variables given values, as recording
    rules for promtool to parse."""
    rules = [{"record": f"dashboard:query_{i}", "expr": promql_of_grafana(expr)}
             for i, expr in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    output = run_promtool(promtool, "check", "rules", path)
    assert f"SUCCESS: {len(rules)} rules found" in output


# --- the rules ----------------------------------------------------------------------------------------------

def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def _rule_count() -> int:
    return len(_rules())


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces as dashes."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook() -> None:
    anchors = _anchors(OPERATIONS.read_text())
    rules = _rules()
    assert rules and all("alert" in r for r in rules), "alerts.yml holds alerts only"
    for rule in rules:
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in SEVERITIES, name
        notes = rule.get("annotations", {})
        assert {"summary", "description", "runbook_url"} <= set(notes), name
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/operations.md" and anchor == name.lower(), (name, notes["runbook_url"])
        assert anchor in anchors, f"docs/operations.md has no heading {name} (the runbook of the alert)"


def test_the_alerts_the_issue_asks_for_exist() -> None:
    names = {r["alert"] for r in _rules()}
    assert {"TrainyardNodeLost", "TrainyardGpuUnhealthy", "TrainyardQueueWaitHigh",
            "TrainyardSchedulerLeaderFlapping", "TrainyardEtcdNearQuota", "TrainyardHistoryBacklog"} <= names


def _expectations() -> Iterator[tuple[str, bool]]:
    """(alert, fires) for every expectation of the unit tests."""
    for path in RULE_TESTS:
        data = yaml.safe_load(path.read_text())
        assert data["rule_files"] == ["../alerts.yml"], path
        for test in data["tests"]:
            for case in test.get("alert_rule_test", []):
                yield case["alertname"], bool(case.get("exp_alerts"))


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    seen = set(_expectations())
    untested = [(name, fires) for name in sorted({r["alert"] for r in _rules()}) for fires in (True, False)
                if (name, fires) not in seen]
    assert not untested, f"alerts without a unit test that it fires (True) or stays quiet (False): {untested}"


# --- metric names -------------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
_GRAFANA_DURATIONS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
_MODIFIERS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)|"
                        r"\b(?:group_left|group_right)\b|\boffset\s+-?\w+|@\s*\S+")
_NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan"}
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*\w+\s*\)\s*$")


def promql_of_grafana(expr: str) -> str:
    """A Grafana query as Prometheus would receive it: $__rate_interval and the like as durations, the
    dashboard's own variables as match-anything regexes, `label_values(selector, label)` as its selector."""
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group(1)
    return _GRAFANA_VARIABLE.sub(lambda v: _GRAFANA_DURATIONS.get(v.group(1), ".*"), expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges,
    grouping modifiers and numbers are taken out, less functions (a name before '(') and keywords."""
    text = _STRING.sub(" ", promql_of_grafana(expr))
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = _NUMBER.sub(" ", _MODIFIERS.sub(" ", text))
    names = set()
    for m in _IDENTIFIER.finditer(text):
        if m.group(0) in _KEYWORDS or text[m.end():].lstrip().startswith("("):
            continue
        names.add(m.group(0))
    return names


def test_metric_names_are_read_out_of_promql() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, route) (rate(trainyard_gateway_http_request_duration_seconds_'
            'bucket{route!="unmatched", job=~"$job"}[$__rate_interval]))) > 1e-3 and on (instance) '
            'up offset 5m unless count_values("util", DCGM_FI_DEV_GPU_UTIL) or vector(0)')
    assert metric_names(expr) == {"trainyard_gateway_http_request_duration_seconds_bucket", "up",
                                  "DCGM_FI_DEV_GPU_UTIL"}
    assert metric_names('label_values(trainyard_agent_gpu_health{node=~"$node"}, instance)') == {
        "trainyard_agent_gpu_health"}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def _variables() -> list[dict[str, Any]]:
    return list(_dashboard()["templating"]["list"])


def dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for p in _panels(_dashboard()["panels"]) for t in p.get("targets", [])]
    queries = [v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
               for v in _variables() if v["type"] == "query"]
    return exprs + queries


@pytest.fixture(scope="module")
def exported() -> set[str]:
    done = subprocess.run([sys.executable, "-c", _EXPORTED_PROBE], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    names = set(json.loads(done.stdout.splitlines()[-1]))
    # The probe sees what the services register: a wrong import would leave out whole services.
    assert {"trainyard_scheduler_queue_depth", "DCGM_FI_DEV_GPU_UTIL", "trainyard_checkpoint_commits_total",
            "trainyard_gateway_http_request_duration_seconds_bucket", "grpc_server_handled_total"} <= names
    return names


def test_every_metric_the_rules_use_is_exported(exported: set[str]) -> None:
    known = exported | PROMETHEUS_SERIES | ETCD_SERIES
    unknown = {}
    for rule in _rules():
        names = metric_names(rule["expr"])
        assert names, f"{rule['alert']}: no metric read out of {rule['expr']!r}"
        if names - known:
            unknown[rule["alert"]] = sorted(names - known)
    assert not unknown, f"rules query metrics no service exports: {unknown}"


def test_every_metric_the_dashboard_uses_is_exported(exported: set[str]) -> None:
    known = exported | PROMETHEUS_SERIES | ETCD_SERIES
    unknown = {}
    for expr in dashboard_exprs():
        names = metric_names(expr)
        assert names, f"no metric read out of {expr!r}"
        if names - known:
            unknown[expr] = sorted(names - known)
    assert not unknown, f"dashboard queries metrics no service exports: {unknown}"


def test_the_etcd_series_are_what_etcd_exports() -> None:
    """The members' metrics listener, as prometheus.yml's comment tells operators to open it, serves the etcd
    series the rules use (etcd from Debian's etcd-server, as the rest of the tests run it)."""
    port = etcd_proc.free_port()
    member = etcd_proc.start_single(extra_args=["--listen-metrics-urls", f"http://127.0.0.1:{port}"])

    def scrape() -> str | None:
        # etcd opens the metrics listener after the client port start_single waited for.
        try:
            reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0)
        except httpx.ConnectError:
            return None
        reply.raise_for_status()
        return reply.text

    try:
        text = until(scrape, 20.0, f"etcd's metrics listener on port {port}")
    finally:
        etcd_proc.stop_and_clean(member)
    names = {s.name for s in Scrape.parse(text).samples}
    assert names >= ETCD_SERIES, sorted(ETCD_SERIES - names)
    assert "--listen-metrics-urls http://0.0.0.0:2381" in SCRAPE_CONFIG.read_text()


# --- the scrape configuration --------------------------------------------------------------------------------

def _scrape_jobs() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(SCRAPE_CONFIG.read_text())
    return {job["job_name"]: job for job in data["scrape_configs"]}


def _targets(job: dict[str, Any]) -> list[str]:
    groups = list(job.get("static_configs", []))
    for sd in job.get("file_sd_configs", []):
        for pattern in sd["files"]:
            files = sorted(PROMETHEUS.glob(pattern))
            assert files, f"{job['job_name']}: no target file matches {pattern}"
            for path in files:
                groups.extend(yaml.safe_load(path.read_text()))
    return [t for group in groups for t in group["targets"]]


@pytest.mark.parametrize("job_name", sorted(SCRAPE_JOBS))
def test_every_service_is_scraped_on_its_metrics_port(job_name: str) -> None:
    jobs = _scrape_jobs()
    assert job_name in jobs
    settings = yaml.safe_load((CONFIGS / f"{SCRAPE_JOBS[job_name]}.yaml").read_text())
    targets = _targets(jobs[job_name])
    assert targets and all(t.rpartition(":")[2] == str(settings["metrics_port"]) for t in targets), targets
    assert jobs[job_name].get("metrics_path", "/metrics") == "/metrics"
    assert jobs[job_name].get("scheme", "http") == "http"  # start_metrics_server serves plain HTTP


def test_the_scrape_jobs_are_the_services_and_etcd() -> None:
    assert set(_scrape_jobs()) == {*SCRAPE_JOBS, ETCD_JOB}
    assert _targets(_scrape_jobs()[ETCD_JOB])


def _relabel(job: dict[str, Any], labels: dict[str, str]) -> dict[str, str]:
    """metric_relabel_configs as Prometheus applies them, for the actions the scrape configuration uses
    (replace with a regex on joined source labels, labeldrop); any other action fails here."""
    out = dict(labels)
    for step in job.get("metric_relabel_configs", []):
        action = step.get("action", "replace")
        regex = re.compile(f"^(?:{step.get('regex', '(.*)')})$")
        if action == "labeldrop":
            out = {k: v for k, v in out.items() if not regex.match(k)}
        elif action == "replace":
            value = step.get("separator", ";").join(out.get(s, "") for s in step["source_labels"])
            m = regex.match(value)
            if m:
                new = m.expand(step.get("replacement", "$1").replace("$", "\\"))
                if new:
                    out[step["target_label"]] = new
                else:
                    out.pop(step["target_label"], None)
        else:
            pytest.fail(f"teach _relabel the action {action}")
    return out


def test_the_agents_job_label_becomes_trainyard_job() -> None:
    """The agent's `job` label arrives as `exported_job` (Prometheus keeps `job` for the scrape job) and leaves
    as `trainyard_job`; series of a GPU no job holds get no such label."""
    jobs = _scrape_jobs()
    agent = jobs["trainyard-agent"]
    assert not agent.get("honor_labels", False)
    held = {"job": "trainyard-agent", "exported_job": "j-1", "team": "ml", "gpu": "0"}
    assert _relabel(agent, held) == {"job": "trainyard-agent", TRAINYARD_JOB_LABEL: "j-1", "team": "ml", "gpu": "0"}
    free = {"job": "trainyard-agent", "gpu": "0"}
    assert _relabel(agent, free) == free


def test_the_rules_and_the_dashboard_name_the_trainyard_job_and_scrape_jobs_alike() -> None:
    exprs = [r["expr"] for r in _rules()] + dashboard_exprs()
    texts = [RULES.read_text(), DASHBOARD.read_text()]
    assert not [t for t in texts if "exported_job" in t], "query trainyard_job, as prometheus.yml renames it"
    assert all(TRAINYARD_JOB_LABEL in t for t in texts)
    jobs = set(_scrape_jobs())
    named = {m for e in exprs for m in re.findall(r'\bjob="([^"]*)"', e)}
    assert named and named <= jobs, named - jobs
    down = next(r for r in _rules() if r["alert"] == "TrainyardTargetDown")
    pattern = re.search(r'job=~"([^"]*)"', down["expr"])
    assert pattern and all(re.fullmatch(pattern.group(1), j) for j in jobs)


# --- the dashboard ------------------------------------------------------------------------------------------

def test_the_dashboard_is_importable() -> None:
    """What Grafana needs to import it on any instance: a schema version, no fixed data source (a variable the
    importer picks), ids unique over every panel, each panel with the data source and at least one query."""
    data = _dashboard()
    assert isinstance(data["schemaVersion"], int) and data["schemaVersion"] >= 36
    assert data["title"] and data["uid"]
    variables = {v["name"]: v for v in _variables()}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(_panels(data["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    source = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels:
        if panel["type"] == "row":
            continue
        where = f"panel {panel['id']} {panel['title']!r}"
        assert panel.get("datasource") == source, where
        targets = panel.get("targets", [])
        assert targets and all(t.get("expr") and t.get("datasource") == source for t in targets), where
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), where
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == source, v["name"]


def test_the_dashboards_variables_are_defined() -> None:
    defined = {v["name"] for v in _variables()}
    used = {m for e in dashboard_exprs() for m in _GRAFANA_VARIABLE.findall(e)} - set(_GRAFANA_DURATIONS)
    assert used and used <= defined, used - defined
    assert {"node", "team", "queue"} <= used


def test_the_dashboard_has_the_rows_the_docs_name() -> None:
    rows = [p["title"] for p in _dashboard()["panels"] if p["type"] == "row"]
    for wanted in ("Fleet", "Jobs", "Scheduler", "Checkpoints", "Gateway"):
        assert wanted in rows, rows


def test_the_dashboards_panels_do_not_overlap() -> None:
    """Panels of the open layout, and those of each collapsed row among themselves (Grafana lays those out
    when the row opens)."""
    def cells(panels: list[dict[str, Any]]) -> None:
        taken: dict[tuple[int, int], int] = {}
        for p in panels:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, p["id"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in taken, f"panels {taken.get((x, y))} and {p['id']} overlap"
                    taken[(x, y)] = p["id"]

    top = _dashboard()["panels"]
    cells(top)
    for row in top:
        if row.get("collapsed"):
            cells(row["panels"])
