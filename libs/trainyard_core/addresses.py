"""host:port addresses as settings and command lines give them. Standard library only (command-line tools
import it)."""

from __future__ import annotations


def host_port(text: str) -> tuple[str, int] | None:
    """'host:port' → (host, port); None when `text` is not one (no host, no port, a port outside 1-65535)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def address_list(text: str) -> list[str]:
    """A comma-separated list of addresses, each stripped, empty items dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]
