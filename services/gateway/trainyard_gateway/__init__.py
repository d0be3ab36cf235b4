"""Trainyard gateway: the public HTTP/JSON API and dashboard."""
