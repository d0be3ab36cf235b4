"""NVML: the adapter (`adapter.py`, the one place that calls it), its event set and topology arithmetic, and a
fake NVML with hardware profiles for hosts without GPUs."""
