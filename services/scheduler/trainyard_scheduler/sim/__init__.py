"""A discrete-event simulator of the placement core, a synthetic fleet and trace, and the type-unaware
gang FIFO baseline the benchmark compares against. Pure and deterministic: no clock, store or I/O."""

from .baseline import GangFifo, gang_fifo
from .fleet import FleetShape, make_fleet
from .simulator import BUCKETS, JobRecord, SimResult, SimulationError, Simulator
from .trace import TraceJob, synthetic_trace, trace_job

__all__ = [
    "BUCKETS", "FleetShape", "GangFifo", "JobRecord", "SimResult", "SimulationError", "Simulator", "TraceJob",
    "gang_fifo", "make_fleet", "synthetic_trace", "trace_job",
]
