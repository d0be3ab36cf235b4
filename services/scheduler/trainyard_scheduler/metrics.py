"""Prometheus metrics of the scheduler (served when --metrics-port is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILE_SECONDS = Histogram(
    "trainyard_scheduler_reconcile_seconds", "Duration of one reconcile cycle (snapshot, decide, commit)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
GANGS_PLACED = Counter("trainyard_scheduler_gangs_placed_total", "Gangs committed to an allocation")
PLACEMENT_CONFLICTS = Counter("trainyard_scheduler_write_conflicts_total",
                              "Leader writes that lost a compare-and-swap (retried next cycle)")
JOBS = Gauge("trainyard_scheduler_jobs", "Active jobs by state", ["state"])
JOBS_FINISHED = Counter("trainyard_scheduler_jobs_finished_total", "Jobs that reached a terminal state", ["state"])
GPUS_ALLOCATED = Gauge("trainyard_scheduler_gpus_allocated", "GPUs held by allocations")
GPUS_TOTAL = Gauge("trainyard_scheduler_gpus_healthy", "Healthy GPUs on live nodes")
NODES = Gauge("trainyard_scheduler_nodes", "Registered nodes by liveness", ["alive"])
PULSES = Counter("trainyard_scheduler_pulses_total",
                 "Liveness pulses received from agents, by result (accepted, or why one was dropped)", ["result"])
PULSE_ACKS_DROPPED = Counter("trainyard_scheduler_pulse_acks_dropped_total",
                             "Pulse acknowledgements the kernel would not send (a full send buffer, no route)")
PULSE_SESSIONS = Gauge("trainyard_scheduler_pulse_sessions", "Open liveness pulse sessions (one per agent stream)")
IS_LEADER = Gauge("trainyard_scheduler_is_leader", "1 while this replica leads")
AGENT_CALL_FAILURES = Counter("trainyard_scheduler_agent_call_failures_total", "Failed launch/stop calls to agents",
                              ["kind"])
PREEMPTIONS = Counter("trainyard_scheduler_preemptions_total", "Gangs stopped to make room for another job")
MIRROR_BEHIND = Counter("trainyard_scheduler_mirror_behind_total",
                        "Cycles skipped because the watch had not yet delivered this leader's own writes")
HISTORY_BACKLOG = Gauge("trainyard_scheduler_history_backlog_jobs",
                        "Finished jobs not yet written to the history store (they stay in etcd until they are)")
HISTORY_ARCHIVED = Counter("trainyard_scheduler_history_archived_total", "Finished jobs written to the history store")
HISTORY_ERRORS = Counter("trainyard_scheduler_history_errors_total",
                         "Archiving and pruning passes that failed because the history store could not be reached")
# Named under the scheduler's prefix like every metric it exports (deploy/README.md's table is tested for it).
HISTORY_PRUNED = Counter("trainyard_scheduler_history_pruned_total",
                         "Rows the leader deleted from the history store past their retention, by kind (job: a job's "
                         "row with its labels; usage: a usage record)", ["kind"])
AUDIT_MOVED = Counter("trainyard_scheduler_audit_moved_total",
                      "Audit entries the leader moved from etcd into the history store")
AUDIT_BACKLOG = Gauge("trainyard_scheduler_audit_backlog_entries",
                      "Audit entries in etcd at the leader's last pass, not yet moved to the history store (they "
                      "stay there, under their retention lease, until they are)")
JOBS_EXPIRED = Counter("trainyard_scheduler_jobs_expired_total",
                       "Archived jobs removed from etcd once job_ttl_s had passed since they ended")
CREDENTIAL_RENEWALS = Counter("trainyard_scheduler_credential_renewals_total",
                              "Deliveries of a renewed checkpoint-store credential to a node of a running attempt, by "
                              "result (ok; unavailable: the agent could not be reached; refused: the agent said no; "
                              "error: not minted or the node is not registered). Failures are retried next pass",
                              ["result"])
