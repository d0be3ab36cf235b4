"""Trainyard node agent: GPU inventory and health through NVML, worker supervision."""
