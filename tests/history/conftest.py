"""Fixtures of the history store's contract tests: every test runs once on SQLite (a fresh file) and once on
PostgreSQL (a fresh database on the session's throwaway server, reached over TCP with a password as
production reaches it, and collated by ICU en-US where the server can, so that ordering and prefix queries are
tested against a linguistic collation rather than the byte order that would hide collation bugs).

The server starts only when a PostgreSQL-parametrized test first asks for it (about a second).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from trainyard_core.testing import postgres
from trainyard_scheduler.history import HistoryStore

BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[postgres.PostgresServer]:
    """The session's PostgreSQL server (initdb into tmpfs, 127.0.0.1 on a free port)."""
    server = postgres.start()
    try:
        yield server
    finally:
        postgres.stop_and_clean(server)


@pytest.fixture(scope="session")
def postgres_icu_locale(postgres_server: postgres.PostgresServer) -> str | None:
    """The collation the tests' databases use: ICU en-US where the server has ICU, else the server's own."""
    return "en-US" if postgres_server.supports_icu() else None


@pytest.fixture
def postgres_url(postgres_server: postgres.PostgresServer, postgres_icu_locale: str | None) -> Iterator[str]:
    """The URL of a new, empty database on the session's server, dropped after the test."""
    name = f"history_{uuid.uuid4().hex[:12]}"
    url = postgres_server.create_database(name, icu_locale=postgres_icu_locale)
    try:
        yield url
    finally:
        postgres_server.drop_database(name)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """The URL of a new SQLite file (not yet created)."""
    return f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"


@pytest.fixture(params=BACKENDS)
def history_url(request: pytest.FixtureRequest) -> str:
    """An empty database of each backend in turn."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture
async def store(history_url: str) -> AsyncIterator[HistoryStore]:
    """A store opened (and migrated) on an empty database of each backend."""
    opened = await HistoryStore.open(history_url)
    try:
        yield opened
    finally:
        await opened.close()
