"""Shared library of the Trainyard services: settings, logging, errors, gRPC bootstrap, the store."""
