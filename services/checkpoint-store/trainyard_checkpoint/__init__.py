"""Trainyard checkpoint store: checkpoint metadata and lifecycle."""
