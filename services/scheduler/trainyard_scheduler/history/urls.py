"""Which history store URLs the scheduler takes: the two drivers it is built and tested with."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

DRIVERS = {"postgresql+asyncpg": "PostgreSQL", "sqlite+aiosqlite": "SQLite"}
EXAMPLES = "postgresql+asyncpg://trainyard:PASSWORD@db.example:5432/trainyard or sqlite+aiosqlite:////var/lib/trainyard/history.db"


def check_url(url: str) -> URL:
    """The parsed URL; ValueError saying what to write instead (the password never shown)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(f"history_url is not a database URL: write e.g. {EXAMPLES}") from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.drivername not in DRIVERS:
        raise ValueError(f"history_url {shown}: the driver must be one of {', '.join(sorted(DRIVERS))} "
                         f"(e.g. {EXAMPLES})")
    if parsed.drivername.startswith("sqlite") and parsed.database in (None, "", ":memory:"):
        raise ValueError(f"history_url {shown}: SQLite needs a file (sqlite+aiosqlite:////path/to/history.db); an "
                         "in-memory database would lose the history at every restart")
    if parsed.drivername.startswith("postgresql") and not parsed.host:
        raise ValueError(f"history_url {shown}: name the PostgreSQL host (postgresql+asyncpg://user:password@host/db)")
    return parsed
