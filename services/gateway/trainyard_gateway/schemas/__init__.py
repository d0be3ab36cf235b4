"""Pydantic models of the public HTTP API: requests are validated here, responses typed for OpenAPI."""
