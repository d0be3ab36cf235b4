"""The web console in a real browser: Debian's `chromium` (tools/sysdeps.sh installs it), driven headless by
Playwright with `executable_path` (no browser download), against the local cluster's real processes (etcd,
scheduler, checkpoint-store, gateway, three simulated nodes; mTLS between them all) started once for the module.

Screenshots go to test-artifacts/console/ in the repository (git-ignored; TRAINYARD_CONSOLE_ARTIFACTS moves it),
named in the terminal summary. A page that throws an uncaught script error, or whose Content-Security-Policy
refuses something the console does, fails its test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, sync_playwright

from trainyard_cli.local import LocalCluster

from ..e2e.conftest import Api, local_cluster

CHROMIUM = Path("/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("TRAINYARD_CONSOLE_ARTIFACTS", REPO / "test-artifacts" / "console"))
VIEWPORT = {"width": 1440, "height": 900}  # a laptop screen
_SAVED: list[Path] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _SAVED:
        terminalreporter.write_sep("-", f"console screenshots in {ARTIFACTS}")
        for path in _SAVED:
            terminalreporter.write_line(str(path))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory, "console") as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[Api]:
    a = Api(cluster)
    a.wait_nodes_ready(len(cluster.nodes))
    yield a
    a.http.close()


# Module scope, not session: Playwright's sync API runs an event loop in this thread while it is open, and the
# async tests of other modules (pytest-asyncio) cannot start theirs inside it.
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (bash tools/sysdeps.sh test)")
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
    try:
        yield browser
    finally:
        browser.close()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    return ARTIFACTS


class Screens:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def shoot(self, page: Page, name: str) -> Path:
        path = self.directory / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        _SAVED.append(path)
        return path


@pytest.fixture
def screens(artifacts: Path) -> Screens:
    return Screens(artifacts)


class Tab:
    """A fresh browser context (its own sessionStorage) on the cluster's console, collecting script errors."""

    def __init__(self, browser: Browser, cluster: LocalCluster) -> None:
        self.context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
        self.page = self.context.new_page()
        self.base = f"{cluster.url}/console/"
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        self.page.on("console", self._console)

    def _console(self, message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text or "Content-Security-Policy" in message.text:
            self.errors.append(f"CSP: {message.text}")

    def open(self, route: str = "") -> Page:
        self.page.goto(self.base + (f"#{route}" if route else ""))
        return self.page

    def login(self, token: str, route: str = "/fleet") -> Page:
        page = self.open(route)
        page.get_by_label("API token").fill(token)
        page.get_by_role("button", name="Log in").click()
        page.get_by_test_id("whoami").wait_for()
        return page

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Browser, cluster: LocalCluster) -> Iterator[Tab]:
    t = Tab(browser, cluster)
    try:
        yield t
    finally:
        t.close()
    assert not t.errors, "\n".join(t.errors)


@pytest.fixture
def second_tab(browser: Browser, cluster: LocalCluster) -> Iterator[Tab]:
    t = Tab(browser, cluster)
    try:
        yield t
    finally:
        t.close()
    assert not t.errors, "\n".join(t.errors)
