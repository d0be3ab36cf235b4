"""GPU inventory and metrics through NVML (`adapter.py`), and a fake NVML for hosts without GPUs."""
