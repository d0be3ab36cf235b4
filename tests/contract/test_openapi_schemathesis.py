"""The public API keeps its own OpenAPI contract, as schemathesis judges it with every check, against the
local cluster's real processes (etcd, scheduler, checkpoint-store, gateway, simulated nodes).

Issue 11 ran this by hand and found 15 failure classes: 5xx on PUT /v1/queues and /v1/quotas, schema-valid
requests refused with 400 (the gateway advertised limits the scheduler refused), `{"healthy": 0}` accepted,
OPTIONS answered 405 without `Allow`, the logs route answering a content type its schema did not declare.
Here it runs in `make test`: every operation, every phase (examples, coverage, fuzzing, stateful), a
bounded number of examples per operation, with the cluster's admin token, and the test fails on any
failure schemathesis reports: a 5xx, a schema-violating request accepted, a schema-valid request refused
with a status the check does not expect, a status or content type the document does not declare, a body or
header that does not match its schema, a 405 without `Allow`, an `Allow` that differs from the document.
Nothing is excluded: what a route legitimately answers (404 for an id that names nothing, 409 for a valid
request the cluster cannot take) is declared in the document instead.

The seed is fixed, so a run is repeatable; TRAINYARD_SCHEMATHESIS_SEED and
TRAINYARD_SCHEMATHESIS_EXAMPLES explore further (`make test` keeps the defaults, about a minute here).
The report names each failure with a curl command that reproduces it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import StopReason, events, from_schema
from schemathesis.engine.statistic import Statistic

from trainyard_cli.local import LocalCluster

from ..e2e.conftest import Api, local_cluster

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("TRAINYARD_SCHEMATHESIS_SEED", "20261201"))
MAX_EXAMPLES = int(os.environ.get("TRAINYARD_SCHEMATHESIS_EXAMPLES", "30"))
# A bound on the run, not an expectation: it takes about a minute, and being stopped fails the test. (Not
# schemathesis' own max-time, which makes fuzzing and stateful testing fill whatever time they are given.)
MAX_TIME_S = 420
# The checks the finding is about; all are on (the config enables every check), these are asserted by name
# so a renamed or dropped check cannot silently pass.
REQUIRED_CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                   "response_schema_conformance", "response_headers_conformance", "positive_data_acceptance",
                   "negative_data_rejection", "unsupported_method", "allow_header_conformance",
                   "missing_required_header", "ignored_auth", "use_after_free", "ensure_resource_availability")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory, "schemathesis") as c:
        api = Api(c)
        try:
            api.wait_nodes_ready(len(c.nodes))  # node routes are tested against real nodes, not only 404s
        finally:
            api.http.close()
        yield c


@dataclass
class Run:
    stat: Statistic = field(default_factory=Statistic)
    errors: list[str] = field(default_factory=list)
    stop: StopReason | None = None
    seconds: float = 0.0
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    checks: set[str] = field(default_factory=set)

    def record(self, recorder: Any) -> None:
        self.stat.on_scenario_finished(recorder)
        for case_id, node in recorder.cases.items():
            interaction = recorder.interactions.get(case_id)
            if interaction is not None and interaction.response is not None:
                label = node.value.operation.label
                self.statuses.setdefault(label, Counter())[interaction.response.status_code] += 1
        self.checks.update(check.name for checks in recorder.checks.values() for check in checks)

    def report(self, config: Any) -> str:
        lines = [f"seed {SEED}, {MAX_EXAMPLES} examples per operation: {self.stat.total_cases} cases, "
                 f"{len(self.stat.unique_failures_map)} unique failures, {len(self.errors)} errors, stopped: "
                 f"{self.stop}"]
        for label, groups in self.stat.failures.items():
            lines.append(f"___ {label}")
            for i, group in enumerate(groups.values(), 1):
                lines.append(group.format(index=i, curl=group.code_sample, config=config))
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)


def run_schemathesis(url: str, token: str) -> tuple[Run, Any]:
    config = SchemathesisConfig.from_dict({
        "seed": SEED,
        "headers": {"Authorization": f"Bearer {token}"},
        # A schema-valid request may also be refused with 422 idempotency_key_reused: an Idempotency-Key sent
        # before with another body (POST /v1/jobs and :resubmit share the keys), as the document declares.
        "checks": {"enabled": True, "positive_data_acceptance": {"expected-statuses": [
            "2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]}},
        "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
        "suppress-health-check": ["all"],
        "request-timeout": 30,
    })
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    run = Run()
    start = time.monotonic()
    stream = from_schema(schema).execute()
    watchdog = threading.Timer(MAX_TIME_S, stream.stop)
    watchdog.start()
    try:
        _consume(stream, run)
    finally:
        watchdog.cancel()
    run.seconds = time.monotonic() - start
    return run, schema


def _consume(stream: Iterable[events.EngineEvent], run: Run) -> None:
    for event in stream:
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            run.record(event.recorder)
        elif isinstance(event, events.NonFatalError):
            run.errors.append(f"{event.label}: {event.value!r}")
        elif isinstance(event, events.FatalError):
            run.errors.append(f"fatal: {event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            run.stop = event.stop_reason
            run.errors += [f"after the run: {f}" for f in event.failures]


def test_the_api_keeps_its_openapi_contract(cluster: LocalCluster) -> None:
    run, schema = run_schemathesis(cluster.url, cluster.token)
    report = run.report(schema.config.output)
    print(report)
    print(f"schemathesis ran {run.stat.total_cases} cases in {run.seconds:.0f}s")
    for label, counts in sorted(run.statuses.items()):
        print(f"  {label}: {dict(sorted(counts.items()))}")

    assert run.stop == StopReason.COMPLETED, report
    assert not run.errors, report
    assert not run.stat.unique_failures_map, report
    operations = {op.ok().label for op in schema.get_all_operations()}
    assert run.stat.tested_operations == operations, report
    assert set(REQUIRED_CHECKS) <= run.checks, sorted(run.checks)
    # The admin token held for the whole run (a request cannot revoke the token it is made with), so every
    # operation was judged on answers past authentication, not on 401s.
    for label in operations:
        assert set(run.statuses[label]) - {401, 403}, (label, run.statuses[label])
    # And the happy paths were reached, not only refusals: jobs were accepted, queues, quotas and tokens made.
    for label, status in [("POST /v1/jobs", 201), ("PUT /v1/queues/{name}", 201), ("PUT /v1/quotas/{team}", 201),
                          ("POST /v1/tokens", 201), ("GET /v1/nodes/{node_id}", 200), ("GET /v1/usage", 200)]:
        assert run.statuses[label][status] > 0, (label, run.statuses[label])
