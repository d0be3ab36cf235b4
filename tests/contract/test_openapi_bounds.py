"""The OpenAPI document's bounds are the scheduler's, field by field (issue 11: the gateway advertised
nodes ≤ 10,000, gpus_per_node ≤ 1,024, priority ±2³¹ and max_restarts 1,000 while the scheduler refused
anything above 4,096, 64, ±1,000 and 100, and minted tokens for a team whose every job it then refused).

For every bounded field of a job spec, a queue, a quota and a token: the keyword in the gateway's OpenAPI
schema equals the `trainyard_core.contract` constant, and at the boundary both the gateway's request model
and the scheduler's validation accept the value while one step past it both refuse it. The scheduler is
driven as the gateway drives it: the body becomes the proto the gateway sends (`ParseDict`), the scheduler's
own conversion turns it into the domain object, and its validation function judges it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from google.protobuf import json_format
from pydantic import BaseModel, ValidationError

from trainyard.common.v1 import types_pb2
from trainyard_core import contract as c
from trainyard_core.errors import InvalidArgument
from trainyard_core.ids import is_valid_id
from trainyard_gateway import tokens as gateway_tokens
from trainyard_gateway.app import create_app
from trainyard_gateway.schemas.jobs import JobSubmit
from trainyard_gateway.schemas.queues import QueuePut
from trainyard_gateway.schemas.quotas import QuotaPut
from trainyard_gateway.schemas.tokens import TokenCreate
from trainyard_scheduler.domain.queues import validate_queue, validate_quota
from trainyard_scheduler.domain.validation import validate_spec, validate_team
from trainyard_scheduler.grpc import convert as scheduler_convert


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return create_app(None).openapi()  # type: ignore[arg-type]  # the document needs no dependencies


def schema_at(doc: dict[str, Any], component: str, path: tuple[str, ...]) -> dict[str, Any]:
    """The schema of a property path below a component; `$ref`s followed, `X | None` taken as X. A path
    element that is not a property name is a keyword (items, additionalProperties, propertyNames, ...)."""
    node: dict[str, Any] = doc["components"]["schemas"][component]
    for part in path:
        node = _resolve(doc, node)
        node = node["properties"][part] if part in node.get("properties", {}) else node[part]
        if isinstance(node, list):  # prefixItems
            node = node[0]
    return _resolve(doc, node)


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while True:
        if "$ref" in node:
            node = doc["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
        elif "anyOf" in node:
            node = next(n for n in node["anyOf"] if n.get("type") != "null")
        else:
            return node


def _merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in change.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# --- the three bodies, each judged by the gateway's model and the scheduler's validation ----------------

SPEC: dict[str, Any] = {"name": "train-1", "command": ["python", "train.py"],
                        "resources": {"nodes": 1, "gpus_per_node": 1}}


def scheduler_job(body: dict[str, Any]) -> None:
    validate_spec(scheduler_convert.spec_from_pb(json_format.ParseDict(body, types_pb2.JobSpec())))


def scheduler_queue(body: dict[str, Any]) -> None:
    name = body.pop("name", "batch")
    validate_queue(scheduler_convert.queue_from_pb(json_format.ParseDict({"name": name, **body},
                                                                          types_pb2.QueueConfig())))


def scheduler_quota(body: dict[str, Any]) -> None:
    team = body.pop("team", "vision")
    validate_quota(scheduler_convert.quota_from_pb(json_format.ParseDict({"team": team, **body},
                                                                          types_pb2.TeamQuota())))


@dataclass(frozen=True)
class Body:
    component: str
    model: type[BaseModel]
    base: dict[str, Any]
    scheduler: Callable[[dict[str, Any]], None]


JOB = Body("JobSubmit", JobSubmit, SPEC, scheduler_job)
QUEUE = Body("QueuePut", QueuePut, {}, scheduler_queue)
QUOTA = Body("QuotaPut", QuotaPut, {}, scheduler_quota)


@dataclass(frozen=True)
class Bound:
    """`keyword` of the schema at `path` is `value`; `body(x)` is the change that puts x there, and `at` and
    `past` are the values at the boundary and one step beyond it."""

    what: Body
    path: tuple[str, ...]
    keyword: str
    value: Any
    body: Callable[[Any], dict[str, Any]]
    at: Any
    past: Any

    @property
    def id(self) -> str:
        return f"{self.what.component}.{'.'.join(self.path)}:{self.keyword}"


def res(key: str) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {"resources": {key: v}}


def top(key: str) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {key: v}


def nested(outer: str, key: str, **beside: Any) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {outer: {**beside, key: v}}


def chars(n: int, ch: str = "x") -> str:
    return ch * n


def numbered(n: int, value: Any = "x", prefix: str = "K") -> dict[str, Any]:
    return {f"{prefix}{i}": value for i in range(n)}


def int_range(what: Body, path: tuple[str, ...], low: int, high: int,
              body: Callable[[Any], dict[str, Any]]) -> list[Bound]:
    return [Bound(what, path, "minimum", low, body, low, low - 1),
            Bound(what, path, "maximum", high, body, high, high + 1)]


def seconds(what: Body, path: tuple[str, ...], high: float, body: Callable[[Any], dict[str, Any]]) -> list[Bound]:
    return [Bound(what, path, "minimum", 0, body, 0.0, -1.0),
            Bound(what, path, "maximum", high, body, high, high + 1)]


BOUNDS: list[Bound] = [
    *int_range(JOB, ("resources", "nodes"), 1, c.MAX_NODES, res("nodes")),
    *int_range(JOB, ("resources", "gpus_per_node"), 0, c.MAX_GPUS_PER_NODE, res("gpus_per_node")),
    *int_range(JOB, ("resources", "cpus_per_node"), 0, c.MAX_CPUS_PER_NODE, res("cpus_per_node")),
    *int_range(JOB, ("resources", "min_memory_gb"), 0, c.MAX_MEMORY_GB, res("min_memory_gb")),
    Bound(JOB, ("resources", "accelerators"), "maxItems", c.MAX_ACCELERATORS,
          lambda n: res("accelerators")([f"m{i}" for i in range(n)]), c.MAX_ACCELERATORS, c.MAX_ACCELERATORS + 1),
    Bound(JOB, ("resources", "vendor"), "maxLength", c.MAX_VENDOR_LENGTH, lambda n: res("vendor")(chars(n)),
          c.MAX_VENDOR_LENGTH, c.MAX_VENDOR_LENGTH + 1),
    Bound(JOB, ("resources", "speed_hints"), "maxProperties", c.MAX_SPEED_HINTS,
          lambda n: res("speed_hints")(numbered(n, 1.0, "m")), c.MAX_SPEED_HINTS, c.MAX_SPEED_HINTS + 1),
    Bound(JOB, ("resources", "speed_hints", "additionalProperties"), "maximum", c.MAX_SPEED_HINT,
          lambda v: res("speed_hints")({"H100": v}), c.MAX_SPEED_HINT, c.MAX_SPEED_HINT + 1),
    Bound(JOB, ("resources", "speed_hints", "additionalProperties"), "exclusiveMinimum", 0,
          lambda v: res("speed_hints")({"H100": v}), 1e-9, 0.0),
    Bound(JOB, ("command",), "minItems", 1, lambda n: top("command")(["python"] * n), 1, 0),
    Bound(JOB, ("command",), "maxItems", c.MAX_COMMAND_ARGS, lambda n: top("command")(["python"] * n),
          c.MAX_COMMAND_ARGS, c.MAX_COMMAND_ARGS + 1),
    Bound(JOB, ("command", "items"), "maxLength", c.MAX_ARG_LENGTH,
          lambda n: top("command")(["python", chars(n)]), c.MAX_ARG_LENGTH, c.MAX_ARG_LENGTH + 1),
    Bound(JOB, ("command", "prefixItems"), "maxLength", c.MAX_ARG_LENGTH,
          lambda n: top("command")([chars(n)]), c.MAX_ARG_LENGTH, c.MAX_ARG_LENGTH + 1),
    Bound(JOB, ("env",), "maxProperties", c.MAX_ENV_VARS, lambda n: top("env")(numbered(n)),
          c.MAX_ENV_VARS, c.MAX_ENV_VARS + 1),
    Bound(JOB, ("env", "additionalProperties"), "maxLength", c.MAX_ENV_VALUE_LENGTH,
          lambda n: top("env")({"V": chars(n)}), c.MAX_ENV_VALUE_LENGTH, c.MAX_ENV_VALUE_LENGTH + 1),
    Bound(JOB, ("working_dir",), "maxLength", c.MAX_WORKING_DIR_LENGTH,
          lambda n: top("working_dir")("/" + chars(n - 1)), c.MAX_WORKING_DIR_LENGTH, c.MAX_WORKING_DIR_LENGTH + 1),
    *int_range(JOB, ("priority",), c.MIN_PRIORITY, c.MAX_PRIORITY, top("priority")),
    *int_range(JOB, ("max_restarts",), 0, c.MAX_RESTARTS, top("max_restarts")),
    Bound(JOB, ("labels",), "maxProperties", c.MAX_LABELS, lambda n: top("labels")(numbered(n)),
          c.MAX_LABELS, c.MAX_LABELS + 1),
    Bound(JOB, ("labels", "additionalProperties"), "maxLength", c.MAX_LABEL_VALUE_LENGTH,
          lambda n: top("labels")({"k": chars(n)}), c.MAX_LABEL_VALUE_LENGTH, c.MAX_LABEL_VALUE_LENGTH + 1),
    *seconds(JOB, ("topology", "wait_s"), c.MAX_TOPOLOGY_WAIT_S, nested("topology", "wait_s", tier="leaf")),
    *seconds(JOB, ("preemption", "grace_s"), c.MAX_GRACE_S, nested("preemption", "grace_s")),
    *seconds(JOB, ("restart_backoff_s",), c.MAX_RESTART_BACKOFF_S, top("restart_backoff_s")),
    *seconds(JOB, ("time_limit_s",), c.MAX_TIME_LIMIT_S, top("time_limit_s")),
    *seconds(JOB, ("checkpoint", "interval_s"), c.MAX_CHECKPOINT_INTERVAL_S, nested("checkpoint", "interval_s")),
    *int_range(JOB, ("checkpoint", "every_steps"), 0, c.MAX_CHECKPOINT_STEPS, nested("checkpoint", "every_steps")),
    *int_range(JOB, ("checkpoint", "keep_last"), 0, c.MAX_KEEP_LAST, nested("checkpoint", "keep_last")),
    *int_range(QUEUE, ("tier",), c.MIN_QUEUE_TIER, c.MAX_QUEUE_TIER, top("tier")),
    *int_range(QUEUE, ("max_gpus",), 0, c.MAX_GPUS, top("max_gpus")),
    Bound(QUEUE, ("node_labels",), "maxProperties", c.MAX_NODE_LABELS, lambda n: top("node_labels")(numbered(n)),
          c.MAX_NODE_LABELS, c.MAX_NODE_LABELS + 1),
    Bound(QUEUE, ("node_labels", "additionalProperties"), "maxLength", c.MAX_NODE_LABEL_VALUE_LENGTH,
          lambda n: top("node_labels")({"pool": chars(n)}), c.MAX_NODE_LABEL_VALUE_LENGTH,
          c.MAX_NODE_LABEL_VALUE_LENGTH + 1),
    Bound(QUEUE, ("description",), "maxLength", c.MAX_QUEUE_DESCRIPTION, lambda n: top("description")(chars(n)),
          c.MAX_QUEUE_DESCRIPTION, c.MAX_QUEUE_DESCRIPTION + 1),
    Bound(QUOTA, ("weight",), "maximum", c.MAX_QUOTA_WEIGHT, top("weight"), c.MAX_QUOTA_WEIGHT,
          c.MAX_QUOTA_WEIGHT + 1),
    Bound(QUOTA, ("weight",), "exclusiveMinimum", 0, top("weight"), 1e-9, 0.0),
    Bound(QUOTA, ("limits",), "maxProperties", c.MAX_QUOTA_MODELS,
          lambda n: top("limits")(numbered(n, {"nominal": 1}, "m")), c.MAX_QUOTA_MODELS, c.MAX_QUOTA_MODELS + 1),
    *int_range(QUOTA, ("limits", "additionalProperties", "nominal"), 0, c.MAX_GPUS,
               lambda v: top("limits")({"H100": {"nominal": v}})),
    *int_range(QUOTA, ("limits", "additionalProperties", "borrow_limit"), 0, c.MAX_GPUS,
               lambda v: top("limits")({"H100": {"nominal": 1, "borrow_limit": v}})),
]


@pytest.mark.parametrize("bound", BOUNDS, ids=lambda b: b.id)
def test_the_schema_states_the_schedulers_bound(doc: dict[str, Any], bound: Bound) -> None:
    schema = schema_at(doc, bound.what.component, bound.path)
    assert schema[bound.keyword] == bound.value, schema
    at = _merge(bound.what.base, bound.body(bound.at))
    past = _merge(bound.what.base, bound.body(bound.past))
    bound.what.model.model_validate(copy.deepcopy(at))
    bound.what.scheduler(copy.deepcopy(at))
    with pytest.raises(ValidationError):
        bound.what.model.model_validate(copy.deepcopy(past))
    with pytest.raises(InvalidArgument):
        bound.what.scheduler(copy.deepcopy(past))


# --- names: the same pattern in the schema, and the same verdict from every side -------------------------

@dataclass(frozen=True)
class Rule:
    """The schema at `path` has `name`'s pattern; `body(text)` puts a text there; every text in `good` is
    taken and every one in `bad` refused, by the gateway's model and the scheduler alike."""

    what: Body
    path: tuple[str, ...]
    name: c.Name
    body: Callable[[str], dict[str, Any]]
    good: tuple[str, ...]
    bad: tuple[str, ...]


RULES: list[Rule] = [
    Rule(JOB, ("name",), c.JOB_NAME, top("name"), ("a", "x" * 63, "llama-7b.v2_run"),
         ("", "x" * 64, "Train", "-x", "x-", "my job", "x\n")),
    Rule(JOB, ("queue",), c.QUEUE_NAME.or_empty, top("queue"), ("", "default", "q" * 63, "spot_a-1"),
         ("Batch", "a.b", "q" * 64, "-q", "q\n")),
    Rule(JOB, ("priority_class",), c.PRIORITY_CLASS.or_empty, top("priority_class"), ("", "high", "P" * 63),
         ("no such!", "-x", "P" * 64)),
    Rule(JOB, ("working_dir",), c.WORKING_DIR, top("working_dir"), ("", "/", "/data/run 1"),
         ("relative", "/a\0b")),
    Rule(JOB, ("resources", "accelerator"), c.MODEL_NAME.or_empty, res("accelerator"),
         ("", "H100-80GB-HBM3", "m" * 64), ("H100 80GB", "m" * 65, "Ä100")),
    Rule(JOB, ("resources", "accelerators", "items"), c.MODEL_NAME, lambda t: res("accelerators")([t]),
         ("A100-SXM4-40GB", "m" * 64), ("", " ", "m" * 65)),
    Rule(JOB, ("resources", "speed_hints", "propertyNames"), c.MODEL_NAME, lambda t: res("speed_hints")({t: 1.0}),
         ("H100-80GB-HBM3",), ("", "a b", "m" * 65)),
    Rule(JOB, ("resources", "min_compute_capability"), c.COMPUTE_CAPABILITY.or_empty,
         res("min_compute_capability"), ("", "8.0", "10.12"), ("9", "sm_90", "100.0", "9.0\n")),
    Rule(JOB, ("command", "prefixItems"), c.PROGRAM, lambda t: top("command")([t, "x"]), ("python", "/bin/true"),
         ("", " python", "\tx", "py\0thon")),
    Rule(JOB, ("command", "items"), c.NO_NUL, lambda t: top("command")(["python", t]), ("", " --lr 3e-4\n"),
         ("a\0b",)),
    Rule(JOB, ("env", "propertyNames"), c.ENV_KEY, lambda t: top("env")({t: "1"}), ("_X", "LR", "K" * 128),
         ("1BAD", "A-B", "K" * 129, "")),
    Rule(JOB, ("env", "additionalProperties"), c.NO_NUL, lambda t: top("env")({"V": t}), ("", "a b"), ("a\0",)),
    Rule(JOB, ("labels", "propertyNames"), c.LABEL_KEY, lambda t: top("labels")({t: "v"}),
         ("team", "a/b.c_d-e", "k" * 63), ("", "bad key!", "k" * 64, "-k", "k/")),
    Rule(QUEUE, ("node_labels", "propertyNames"), c.LABEL_KEY, lambda t: top("node_labels")({t: "v"}),
         ("pool", "topology.k8s/zone"), ("", "bad key!", "k" * 64)),
    Rule(QUOTA, ("limits", "propertyNames"), c.MODEL_NAME, lambda t: top("limits")({t: {"nominal": 1}}),
         (c.ANY_MODEL, "H100-80GB-HBM3"), ("", "m" * 65, "H100 80GB")),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.what.component}.{'.'.join(r.path)}")
def test_the_schema_states_the_schedulers_name_rule(doc: dict[str, Any], rule: Rule) -> None:
    assert schema_at(doc, rule.what.component, rule.path)["pattern"] == rule.name.pattern
    for text in rule.good:
        body = _merge(rule.what.base, rule.body(text))
        rule.what.model.model_validate(copy.deepcopy(body))
        rule.what.scheduler(copy.deepcopy(body))
        assert rule.name.matches(text), text
    for text in rule.bad:
        body = _merge(rule.what.base, rule.body(text))
        with pytest.raises(ValidationError):
            rule.what.model.model_validate(copy.deepcopy(body))
        with pytest.raises(InvalidArgument):
            rule.what.scheduler(copy.deepcopy(body))


TEAMS_GOOD = ("a", "vision", "ml-team", "t" * 63, "admin", "default")
TEAMS_BAD = ("", "ml_team", "Vision", "-x", "x-", "t" * 64, "a/b", "x\n")


def test_one_team_rule_for_tokens_jobs_and_quotas(doc: dict[str, Any]) -> None:
    """A token is never minted for a team whose jobs (or quota) the scheduler refuses (`ml_team` was)."""
    assert schema_at(doc, "TokenCreate", ("team",))["pattern"] == c.TEAM.pattern
    paths = doc["paths"]
    for path in ("/v1/quotas/{team}",):
        for parameter in next(iter(paths[path].values()))["parameters"]:
            if parameter["name"] == "team":
                assert parameter["schema"]["pattern"] == c.TEAM.pattern
    for team in TEAMS_GOOD:
        TokenCreate.model_validate({"team": team, "user": "alice"})
        gateway_tokens.validate_team(team)
        validate_team(team)
        scheduler_quota({"team": team})
    for team in TEAMS_BAD:
        with pytest.raises(ValidationError):
            TokenCreate.model_validate({"team": team, "user": "alice"})
        for check in (gateway_tokens.validate_team, validate_team, lambda t: scheduler_quota({"team": t})):
            with pytest.raises(InvalidArgument):
                check(team)


def test_token_user_and_description(doc: dict[str, Any]) -> None:
    assert schema_at(doc, "TokenCreate", ("user",))["pattern"] == c.USER.pattern
    assert schema_at(doc, "TokenCreate", ("description",))["maxLength"] == c.MAX_TOKEN_DESCRIPTION
    for user in ("alice", "a.b+c@example.org", "u" * 128):
        TokenCreate.model_validate({"team": "t", "user": user})
        gateway_tokens.validate_user(user)
    for user in ("", "-a", "u" * 129, "a b"):
        with pytest.raises(ValidationError):
            TokenCreate.model_validate({"team": "t", "user": user})
        with pytest.raises(InvalidArgument):
            gateway_tokens.validate_user(user)


def test_path_and_query_parameters_follow_the_contract(doc: dict[str, Any]) -> None:
    def parameter(path: str, method: str, name: str) -> dict[str, Any]:
        params = doc["paths"][path][method]["parameters"]
        return _resolve(doc, next(p for p in params if p["name"] == name)["schema"])

    for path, method, name in [("/v1/jobs/{job_id}", "get", "job_id"), ("/v1/nodes/{node_id}", "get", "node_id"),
                               ("/v1/tokens/{token_id}", "delete", "token_id")]:
        assert parameter(path, method, name)["pattern"] == c.ID.pattern
    assert parameter("/v1/queues/{name}", "put", "name")["pattern"] == c.QUEUE_NAME.pattern
    assert parameter("/v1/jobs", "get", "page_token")["pattern"] == c.PAGE_TOKEN.or_empty.pattern
    for name, rule in (("user", c.USER), ("team", c.TEAM), ("queue", c.QUEUE_NAME)):
        assert parameter("/v1/jobs", "get", name)["pattern"] == rule.or_empty.pattern
    assert parameter("/v1/jobs", "get", "name_prefix")["maxLength"] == c.MAX_JOB_NAME_LENGTH
    assert parameter("/v1/jobs", "get", "page_size")["maximum"] == c.MAX_PAGE_SIZE
    assert parameter("/v1/jobs", "post", "Idempotency-Key")["pattern"] == c.IDEMPOTENCY_KEY.pattern
    assert set(parameter("/v1/jobs", "get", "state")["items"]["enum"]) == set(c.JOB_STATES)
    # The ids the services mint follow the rule the schema states for them.
    for text in ("job-01m8rd01bvcpnb6077", "tok-x", "node-1"):
        assert c.ID.matches(text) and is_valid_id(text)
    for text in ("ab", "Job-1", "1job", "j" * 64):
        assert not c.ID.matches(text) and not is_valid_id(text)


def test_vocabularies_are_the_contracts(doc: dict[str, Any]) -> None:
    assert schema_at(doc, "TopologyRequest", ("tier",))["enum"] == ["", *c.TOPOLOGY_TIERS]
    assert schema_at(doc, "PreemptionRequest", ("signal",))["enum"] == list(c.PREEMPTION_SIGNALS)
    assert set(schema_at(doc, "Job", ("state",))["enum"]) == {*c.JOB_STATES, "unknown"}
    for tier in c.TOPOLOGY_TIERS:
        scheduler_job(_merge(SPEC, {"topology": {"tier": tier, "required": True}}))
    for signal in c.PREEMPTION_SIGNALS:
        scheduler_job(_merge(SPEC, {"preemption": {"signal": signal}}))
    for tier in ("island", "cluster", "rack"):
        with pytest.raises(InvalidArgument):
            scheduler_job(_merge(SPEC, {"topology": {"tier": tier}}))
    reserved = schema_at(doc, "JobSubmit", ("env", "propertyNames"))["not"]["anyOf"]
    assert reserved[0]["enum"] == list(c.RESERVED_ENV)
    for key in (*c.RESERVED_ENV, c.RESERVED_ENV_PREFIX + "X"):
        with pytest.raises(ValidationError):
            JobSubmit.model_validate(_merge(SPEC, {"env": {key: "1"}}))
        with pytest.raises(InvalidArgument):
            scheduler_job(_merge(SPEC, {"env": {key: "1"}}))


@pytest.mark.parametrize("change", [
    {"resources": {"accelerator": "H100", "accelerators": ["A100"]}},
    {"resources": {"gpus_per_node": 0, "vendor": "nvidia"}},
    {"resources": {"gpus_per_node": 0, "accelerators": ["A100"]}},
    {"resources": {"gpus_per_node": 0, "min_memory_gb": 40}},
    {"resources": {"accelerators": ["A100", "A100"]}},
    {"topology": {"required": True}},
    {"topology": {"wait_s": 60}},
    {"topology": {"tier": "leaf", "required": True, "wait_s": 60}},
    {"command": ["python"] + ["x" * c.MAX_ARG_LENGTH] * (c.MAX_COMMAND_LENGTH // c.MAX_ARG_LENGTH)},
])
def test_rules_between_fields_are_refused_by_both(change: dict[str, Any]) -> None:
    body = _merge(SPEC, change)
    with pytest.raises(ValidationError):
        JobSubmit.model_validate(copy.deepcopy(body))
    with pytest.raises(InvalidArgument):
        scheduler_job(copy.deepcopy(body))


def test_usage_parameters_are_the_contracts(doc: dict[str, Any]) -> None:
    params = {p["name"]: _resolve(doc, p["schema"]) for p in doc["paths"]["/v1/usage"]["get"]["parameters"]}
    assert set(params) == {"from", "to", "group_by", "team", "limit"}
    assert params["group_by"]["enum"] == list(c.USAGE_GROUPS) and params["group_by"]["default"] == "team"
    assert (params["limit"]["minimum"], params["limit"]["maximum"]) == (1, c.MAX_USAGE_ROWS)
    assert params["team"]["pattern"] == c.TEAM.or_empty.pattern
    assert schema_at(doc, "UsageReport", ("group_by",))["enum"] == list(c.USAGE_GROUPS)
