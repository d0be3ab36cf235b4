"""Placement policy: plugins at named extension points (filter, score) and the pure `place` entry."""
