"""Every benchmark in bench/ runs in its TINY configuration through `python -m bench --tiny`, the entry point
`make bench` uses, and must write its figures: the names it documents, each one a finite number, the counts
it was configured with. A settings change that breaks `make bench` (as node-loss detection's validation once
broke bench/agent.py) fails here. Nothing here times anything or checks a target: at these sizes the figures
say nothing about the targets. A new module in bench/ fails `test_every_benchmark_has_a_tiny_run` until it
gets a row in FIGURES."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import __main__ as bench_main
from bench import agent, checkpoint, e2e_latency, fleet, gateway, grpc_accept, heartbeat, history, recovery, scheduler
from trainyard_scheduler.sim.simulator import BUCKETS

REPO = Path(__file__).resolve().parents[2]

_BUCKETS = [label.replace("-", "_") for label, _, _ in BUCKETS]

# The figures each benchmark must report (its docstring's, the targets', the README's).
FIGURES: dict[str, set[str]] = {
    "agent": {
        "agent_cpu_percent_of_core", "agent_rss_mb", "xid_to_scheduler_ms", "xid_to_scheduler_p50_ms",
        "idle_python_cpu_percent_of_core", "idle_python_rss_mb", "getnode_rtt_ms",
        "agent_rss_mb_vs_idle_python_rss_mb", "agent_cpu_percent_of_core_vs_target", "agent_rss_mb_vs_target",
        "xid_to_scheduler_ms_vs_getnode_rtt_ms", "window_s", "xid_injections", "heartbeat_interval_ms",
    },
    "checkpoint": {
        "state_gib", "raw_write_gib_s", "raw_write_direct_gib_s", "raw_read_gib_s", "checksum_gib_s",
        "checksum_gib_s_threads", "torch_save_s", "torch_save_gib_s", "dcp_save_1thread_gib_s",
        "dcp_save_nthreads_gib_s", "dcp_load_gib_s", "save_s", "save_gib_s", "async_blocking_s", "async_total_s",
        "async_first_blocking_s", "load_s", "load_gib_s", "reshard_state_gib", "reshard_save_2ranks_s",
        "load_2_to_2_s", "load_2_to_1_s", "load_2_to_3_s", "reshard_load_vs_load", "save_vs_raw_write",
        "save_vs_dcp", "load_vs_raw_read", "async_stall_vs_torch_save",
    },
    "e2e_latency": {
        "submit_to_running_p50_s", "submit_to_running_p95_s", "direct_spawn_p50_s",
        "submit_to_running_p50_vs_direct_spawn", "tls_vs_plaintext_p50", "jobs",
    },
    "fleet": {
        "nodes", "steady_s", "scheduler_cpu_us_per_node_s", "nodes_per_core", "nodes_per_core_vs_target",
        "scheduler_cpu_percent", "scheduler_cpu_us_per_node_s_no_jobs", "scheduler_idle_cpu_percent",
        "keepalive_floor_us_per_conn_s", "scheduler_no_jobs_vs_keepalive_floor",
        "swarm_cpu_percent", "host_busy_percent", "false_deaths", "live_stream_breaks", "detect_s_p99",
        "detect_s_p50", "detect_s_p99_crash", "detect_s_p99_silent", "detect_vs_target", "stops", "stops_undetected",
        "leader_rss_mb_at_half_n", "leader_rss_mb_at_n", "leader_rss_mb_extrapolated_10k",
        "leader_rss_extrapolated_10k_vs_target", "submit_to_admitted_p50_ms_1gpu", "submit_to_admitted_p99_ms_1gpu",
        "submit_to_admitted_p50_ms_64gpu", "submit_to_admitted_p99_ms_64gpu", "etcd_put_watch_p50_ms",
        "submit_to_admitted_1gpu_vs_floor", "submit_to_admitted_64gpu_vs_floor", "jobs_1gpu_sampled",
        "jobs_64gpu_sampled", "jobs_succeeded", "job_errors", "scheduler_unavailable_reads",
        "failover_false_deaths", "failover_all_ready_s", "failover_crash_at_s", "failover_crash_detect_s_max",
        "submit_p50_ms", "submit_p99_ms",
        "created_to_admitted_event_p50_ms_1gpu", "created_to_admitted_event_p50_ms_64gpu",
    },
    "gateway": {
        "hello_p95_ms", "hello_throughput_rps", "get_p50_ms", "get_p95_ms", "get_throughput_rps", "list_p50_ms",
        "list_p95_ms", "list_throughput_rps", "submit_p50_ms", "submit_p99_ms", "submit_throughput_rps", "errors",
        "get_throughput_vs_hello", "get_p95_vs_hello", "list_throughput_vs_hello", "list_p95_vs_hello", "clients",
        "jobs", "submits", "job_view",
    },
    "grpc_accept": {
        "accept_gap_ms_idle", "accept_gap_ms_busy", "accept_span_ms_idle", "accept_span_ms_busy",
        "accept_gap_busy_vs_loop_turn_ms", "calls", "busy", "burn_us",
    },
    "heartbeat": {
        "heartbeat_cpu_us_tls", "heartbeat_cpu_us_plaintext", "heartbeat_cpu_tls_vs_plaintext", "beat_ack_p50_ms_tls",
        "liveness_cpu_us_per_node_s_tls", "liveness_cpu_us_per_node_s_plaintext", "liveness_cpu_tls_vs_plaintext",
        "scheduler_idle_cpu_percent_tls", "scheduler_idle_cpu_percent_plaintext",
        "beat_ack_p50_ms_plaintext", "beat_ack_p50_tls_vs_plaintext", "nodes", "interval_ms", "windows",
    },
    "history": {
        "jobs", "archive_per_s_postgres", "archive_per_s_sqlite", "list_p50_ms_postgres", "list_p50_ms_sqlite",
        "list_p95_ms_postgres", "list_p95_ms_sqlite", "list_p95_vs_target_postgres", "list_p95_vs_target_sqlite",
        "fleet_nodes", "running_gangs", "pending_jobs", "pushed_jobs", "cycle_ms_none", "cycle_ms_history",
        "cycle_ms_vs_history", "cycle_ms_p90_vs_history", "cycles_sampled", "cycle_ms_twins_before_push",
        "leader_rss_mb_none", "leader_rss_mb_history", "leader_rss_mb_vs_history", "leader_rss_twins_before_push",
        "leader_rss_mb_peak_during_push", "leader_rss_mb_per_100k_jobs_after_first_tenth", "mirror_keys_none",
        "mirror_keys_history", "leader_archive_per_s", "etcd_db_mb_before_push",
        "etcd_db_mb_after_100k_jobs_undefragmented", "etcd_db_in_use_mb_after_100k_jobs_undefragmented",
        "etcd_db_in_use_mb_after_100k_jobs_compacted", "etcd_db_mb_after_100k_jobs",
        "etcd_db_in_use_mb_after_100k_jobs", "etcd_db_vs_target", "etcd_job_keys_after_push",
        "etcd_audit_entries_after_push", "etcd_audit_mb_after_push", "etcd_db_mb_after_100k_jobs_without_audit",
        "history_audit_entries_after_push", "completion_per_s", "archive_vs_completion",
    },
    "recovery": {
        "rounds", "detect_s", "detect_s_median", "detect_to_running_s", "detect_to_running_s_median",
        "first_step_after_resume_s", "first_step_after_resume_s_median", "kill_to_first_step_s_median",
        "steps_lost", "steps_lost_median", "gpu_fault_evacuated_s", "detect_vs_target", "running_vs_target",
        "evacuate_vs_target",
    },
    "scheduler": {
        *scheduler.TARGETS,
        "decisions_per_s_excluding_index", "decisions_per_s_saturated", "decisions_per_s_backlog",
        "index_build_ms", "index_full_build_ms", "place_call_ms_mean", "p99_decision_ms_128node_main",
        "p99_decision_ms_128node_saturated", "p99_decision_ms_128node_burst", "samples_128node_burst",
        "commit_per_s", "etcd_txn_per_s", "etcd_txn_with_encode_per_s", "commit_vs_etcd_txn_with_encode",
        "commits_each", "etcd_txn_with_holdings_per_s", "holdings_txn_vs_etcd_txn",
        "commit_per_s_tls_etcd", "commit_per_s_plaintext_etcd",
        "commit_vs_etcd_txn_with_holdings", "commits_on_node_copies", "jct_s", "jct_s_fifo", "fifo_pending_growth",
        "jct_vs_fifo_high_load",
        "allocation_percent_main", "allocation_percent_saturated", "saturated_share_of_window",
        "mean_tiers_over_optimal", "preemptions", "fleet_nodes", "fleet_gpus", "trace_jobs",
        "saturation_trace_jobs", "backlog_jobs", "wall_s",
        *(f"wait_s_{q}_{b}{arm}" for q in ("p50", "p99") for b in _BUCKETS for arm in ("", "_fifo", "_saturated")),
        *(f"jct_vs_fifo_{b}" for b in _BUCKETS),
    },
}

# Figures that count what the TINY config asked for.
COUNTS: dict[str, dict[str, float]] = {
    "agent": {"xid_injections": agent.TINY.injections, "heartbeat_interval_ms": agent.TINY.heartbeat_interval_ms},
    "checkpoint": {"state_gib": checkpoint.TINY.gib, "reshard_state_gib": checkpoint.TINY.reshard_gib},
    "e2e_latency": {"jobs": e2e_latency.TINY.jobs},
    "fleet": {"nodes": fleet.TINY.nodes, "stops": 2 * fleet.TINY.stop_rounds * fleet.TINY.stop_per_round},
    "gateway": {"clients": gateway.TINY.clients, "jobs": gateway.TINY.jobs, "submits": gateway.TINY.submits},
    "grpc_accept": {"calls": grpc_accept.TINY.calls, "busy": grpc_accept.TINY.busy,
                    "burn_us": grpc_accept.TINY.burn_us},
    "heartbeat": {"nodes": heartbeat.TINY.nodes, "interval_ms": heartbeat.TINY.interval_ms,
                  "windows": heartbeat.TINY.rounds},
    "history": {"jobs": history.TINY.jobs, "pushed_jobs": history.TINY.push, "fleet_nodes": history.TINY.nodes,
                "pending_jobs": history.TINY.pending},
    "recovery": {"rounds": recovery.TINY.rounds},
    "scheduler": {
        "fleet_nodes": scheduler.TINY.nodes, "fleet_gpus": scheduler.TINY.nodes * scheduler.GPUS_PER_NODE,
        "trace_jobs": scheduler.TINY.trace_jobs, "saturation_trace_jobs": scheduler.TINY.sat_jobs,
        "backlog_jobs": scheduler.TINY.backlog_jobs, "samples_128node_burst": scheduler.TINY.burst_jobs,
        "commits_each": scheduler.TINY.commits // scheduler.ROUNDS * scheduler.ROUNDS,
    },
}

SLOW_CLUSTER = {"e2e_latency", "fleet", "gateway", "heartbeat", "recovery"}  # they start the whole local cluster


def test_every_benchmark_has_a_tiny_run() -> None:
    assert set(bench_main.available()) == set(FIGURES)
    for name in FIGURES:
        module = sys.modules[f"bench.{name}"]
        assert isinstance(module.TINY, module.Config), name


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.e2e] if n in SLOW_CLUSTER else [])
                                  for n in sorted(FIGURES)])
def test_tiny_benchmark_writes_its_figures(name: str, tmp_path: Path) -> None:
    # The developer's own BENCH_* overrides must not change the tiny run.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    proc = subprocess.run([sys.executable, "-m", "bench", "--tiny", "--results", str(tmp_path), name], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, f"`python -m bench --tiny {name}` exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    figures: dict[str, Any] = json.loads((tmp_path / f"{name}.json").read_text())
    missing = FIGURES[name] - set(figures)
    assert not missing, f"{name} lacks {sorted(missing)}"
    not_finite = {k: v for k, v in figures.items()
                  if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)}
    assert not not_finite, f"{name}: figures that are not finite numbers: {not_finite}"
    for key, want in COUNTS[name].items():
        assert figures[key] == pytest.approx(want), f"{name}.{key}: {figures[key]} != {want}"
    if name in SANE:
        SANE[name](figures)


def _history_is_sane(f: dict[str, Any]) -> None:
    """What the tiny history run's figures must say whatever the machine's speed: every pushed job went through
    and left etcd (the leader's etcd and mirror hold what its twin's do), the audit log kept a submit and a
    cancel of each (moved to the history store), and every time, size, rate and ratio is a positive number."""
    assert f["etcd_job_keys_after_push"] == f["running_gangs"] + f["pending_jobs"], "pushed jobs left in etcd"
    assert f["mirror_keys_history"] == f["mirror_keys_none"], "the leader's mirror holds more than its twin's"
    # A submit and a cancel of each: in the history store once the leader moved them, in etcd until then.
    assert f["etcd_audit_entries_after_push"] + f["history_audit_entries_after_push"] >= 2 * f["pushed_jobs"]
    assert f["history_audit_entries_after_push"] > 0, "the leader moves the audit log out of etcd"
    assert f["cycles_sampled"] > 0 and f["running_gangs"] > 0
    assert f["etcd_db_mb_after_100k_jobs"] <= f["etcd_db_mb_after_100k_jobs_undefragmented"]
    assert f["etcd_db_mb_after_100k_jobs_without_audit"] <= f["etcd_db_mb_after_100k_jobs"]
    for key in ("leader_rss_mb_none", "leader_rss_mb_history"):
        assert 10 < f[key] < 10_000, f"{key}: {f[key]} MB"
    positive = [k for k in FIGURES["history"] if k.startswith(("cycle_ms", "leader_rss_mb_vs", "leader_rss_twins",
                                                                 "archive_", "list_p", "etcd_db", "completion"))]
    assert not [k for k in positive if not f[k] > 0], {k: f[k] for k in positive if not f[k] > 0}


# Behaviour a benchmark's tiny figures must show beyond being there (not targets: sizes that say nothing of them).
SANE = {"history": _history_is_sane}


# --- the entry point's own rules (in process, no benchmark runs) ---------------------------------------------

def test_unknown_benchmark_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main.main(["no_such_bench"], env={}) == 2
    assert "no_such_bench" in capsys.readouterr().err


def test_a_crash_is_exit_1_and_the_other_benchmarks_still_run(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def run_one(name: str, size: str, results: Path, env: object) -> dict[str, float]:
        ran.append(name)
        if name == "agent":
            raise RuntimeError("scheduler exited with code 2 while starting")
        return {"x": 1.0}

    monkeypatch.setattr(bench_main, "run_one", run_one)
    assert bench_main.main(["agent", "e2e_latency"], env={}) == 1
    assert ran == ["agent", "e2e_latency"]
    assert "crashed: agent" in capsys.readouterr().out


def test_all_benchmarks_ran_is_exit_0_whatever_the_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    # A figure that misses its target (or a bucket with no samples) is a result, not a failure.
    monkeypatch.setattr(bench_main, "run_one", lambda *a: {"decisions_per_s": 1.0, "wait_s": math.nan})
    assert bench_main.main(["scheduler"], env={}) == 0


def test_size_and_overrides_come_from_one_place() -> None:
    assert bench_main.config_for(recovery, "recovery", "full", {}) == recovery.Config()
    assert bench_main.config_for(recovery, "recovery", "tiny", {}) == recovery.TINY
    got = bench_main.config_for(recovery, "recovery", "tiny", {"BENCH_RECOVERY_ROUNDS": "3",
                                                                "BENCH_RECOVERY_STEP_TIME_S": "0.1"})
    assert (got.rounds, got.step_time_s, got.ckpt_every) == (3, 0.1, recovery.TINY.ckpt_every)
    assert bench_main.main(["--tiny", "agent"], env={"BENCH_AGENT_INJECTIONS": "many"}) == 2
    assert bench_main.main(["agent"], env={"BENCH_SIZE": "huge"}) == 2


def test_figures_that_are_not_numbers_are_the_benchmarks_bug() -> None:
    with pytest.raises(TypeError):
        bench_main.check_figures("x", {"a": "1.0"})
    with pytest.raises(TypeError):
        bench_main.check_figures("x", {})
    assert bench_main.check_figures("x", {"a": 1, "b": math.nan})["a"] == 1.0


def test_agent_benchmark_settings_pass_the_schedulers_validation() -> None:
    """The bug behind this directory: bench/agent.py's scheduler settings were refused at start-up."""
    from trainyard_scheduler.settings import SchedulerSettings

    for config in (agent.Config(), agent.TINY, agent.Config(heartbeat_interval_ms=500)):
        settings = SchedulerSettings.model_validate(config.scheduler_settings())
        assert settings.heartbeat_interval_ms == config.heartbeat_interval_ms
