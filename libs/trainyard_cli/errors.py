"""Errors the CLI reports as `error: <message>`: exit 1 for API and network failures, 2 for usage."""

from __future__ import annotations


class CliError(Exception):
    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(CliError):
    """The command line, a spec file or the configuration is wrong; nothing was sent."""

    exit_code = 2
