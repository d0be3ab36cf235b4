"""Start a real, throwaway PostgreSQL server (the Debian `postgresql` package, 14 or newer) for tests.

The server is initialised (`initdb`) into a fresh temporary directory on tmpfs, listens on 127.0.0.1 only on a
free port, keeps its unix socket inside that directory, and runs with durability off (fsync, synchronous
commit and full-page writes): a crashed test server is thrown away, never recovered.

It is reached the way production reaches its database: over TCP, as an ordinary role (`trainyard`, CREATEDB
but not superuser) with a password checked by SCRAM-SHA-256, through a `postgresql+asyncpg://` URL that carries
that password. The bootstrap superuser `postgres` is reachable only through the unix socket (trust), which only
this process's user can open; the helpers here use it for what no service does (creating and dropping
databases).

PostgreSQL refuses to run as root. When the tests run as root, initdb, postgres, pg_ctl and psql run as the
Debian `postgres` system user (the package creates it) and the directory is handed to that user.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from . import accounts
from .etcd import free_port

POSTGRES_MISSING = (
    "PostgreSQL is not installed (no /usr/lib/postgresql/<version>/bin/postgres). On Debian/Ubuntu run: "
    "sudo apt-get install -y postgresql (`make test` does it when run as root)."
)

SUPERUSER = "postgres"
APP_USER = "trainyard"
DEFAULT_DATABASE = "trainyard"
_DEBIAN_ROOT = Path("/usr/lib/postgresql")
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")

# Speed over durability: nothing here outlives the test run. listen_addresses keeps the server off every
# interface but loopback.
_SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "wal_level": "minimal",
    "max_wal_senders": "0",
    "max_connections": "200",
    "shared_buffers": "128MB",
    "logging_collector": "off",
    "log_min_messages": "warning",
    "password_encryption": "scram-sha-256",
}


def find_bin_dir() -> Path:
    """The bin directory of the highest installed PostgreSQL version (Debian keeps each version's server
    programs in /usr/lib/postgresql/<version>/bin, off PATH); else the one holding `postgres` on PATH."""
    versions: list[tuple[int, Path]] = []
    if _DEBIAN_ROOT.is_dir():
        for child in _DEBIAN_ROOT.iterdir():
            if child.name.isdigit() and (child / "bin" / "postgres").is_file():
                versions.append((int(child.name), child / "bin"))
    if versions:
        return max(versions)[1]
    on_path = shutil.which("postgres")
    if on_path and (Path(on_path).parent / "initdb").is_file():
        return Path(on_path).parent
    raise RuntimeError(POSTGRES_MISSING)


def _tmp_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _service_account() -> pwd.struct_passwd | None:
    """Who runs PostgreSQL's programs: None (this process's user) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SUPERUSER)
    except KeyError:
        raise RuntimeError("PostgreSQL refuses to run as root, and there is no `postgres` system user to run it "
                           "as; install the Debian package (sudo apt-get install -y postgresql), which creates "
                           "it, or run the tests as an ordinary user.") from None


@dataclass
class PostgresServer:
    """One running server. `url(database)` is how a client reaches a database as the application role."""

    bin_dir: Path
    base_dir: Path
    host: str
    port: int
    password: str
    account: pwd.struct_passwd | None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def socket_dir(self) -> Path:
        return self.base_dir / "sock"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "postgres.log"

    def url(self, database: str = DEFAULT_DATABASE) -> str:
        """The SQLAlchemy URL of `database` as the application role, password included (mask it before
        printing: sqlalchemy's URL.render_as_string(hide_password=True))."""
        return (f"postgresql+asyncpg://{APP_USER}:{quote(self.password, safe='')}@{self.host}:{self.port}/"
                f"{database}")

    def _run(self, args: list[str], *, what: str, timeout: float = 60.0, stdin: str = "") -> str:
        """Run one of PostgreSQL's programs as its account; RuntimeError with its output if it fails."""
        try:
            done = subprocess.run(self._as_account(args), input=stdin.encode(), capture_output=True, timeout=timeout,
                                  env=self._env(), cwd=self.base_dir, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{what}: {args[0]} did not finish within {timeout}s") from exc
        if done.returncode != 0:
            out = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
            raise RuntimeError(f"{what}: {Path(args[0]).name} exited with {done.returncode}:\n{out}")
        return done.stdout.decode(errors="replace")

    def _as_account(self, args: list[str]) -> list[str]:
        """`args` run as the account through setpriv (see `accounts`: a test process must not fork), or as they are."""
        if self.account is None:
            return args
        return accounts.as_account(self.account.pw_uid, self.account.pw_gid, args)

    def _env(self) -> dict[str, str]:
        # Inherited PG* variables (PGHOST, PGPASSWORD, PGSERVICE ...) would point the tools elsewhere.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C.UTF-8"
        if self.account is not None:
            env["HOME"] = self.account.pw_dir
            env["USER"] = env["LOGNAME"] = self.account.pw_name
        return env

    def psql(self, sql: str, *, database: str = "postgres") -> str:
        """Run SQL as the superuser over the unix socket; fail on the first error. The SQL goes in on stdin, so
        a password in it never shows in a process listing."""
        return self._run([str(self.bin_dir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                          "-h", str(self.socket_dir), "-p", str(self.port), "-U", SUPERUSER, "-d", database],
                         what="psql", stdin=sql)

    def create_database(self, name: str, *, icu_locale: str | None = None) -> str:
        """A new, empty database owned by the application role; returns its URL. With `icu_locale` (e.g.
        "en-US", see `supports_icu`) its collation is that ICU locale's, linguistic like most production
        databases' (`aBc` sorts between `ab` and `ac`), rather than the server's C.UTF-8."""
        _check_identifier(name)
        if icu_locale is None:
            self.psql(f"CREATE DATABASE {name} OWNER {APP_USER}")
        else:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", icu_locale):
                raise ValueError(f"ICU locale {icu_locale!r} is not a plain locale name")
            self.psql(f"CREATE DATABASE {name} OWNER {APP_USER} TEMPLATE template0 LOCALE_PROVIDER icu "
                      f"ICU_LOCALE '{icu_locale}' LOCALE 'C.UTF-8'")
        return self.url(name)

    def supports_icu(self) -> bool:
        """Whether databases may use ICU collations (PostgreSQL >= 15 built with ICU, as Debian's is)."""
        out = self.psql("SELECT current_setting('server_version_num')::int >= 150000 "
                        "AND EXISTS (SELECT 1 FROM pg_collation WHERE collprovider = 'i')")
        return out.strip() == "t"

    def drop_database(self, name: str) -> None:
        """Drop `name`, disconnecting whoever is still connected to it (PostgreSQL >= 13)."""
        _check_identifier(name)
        self.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def initdb(self) -> None:
        pwfile = self.base_dir / "superuser.pw"
        pwfile.write_text(secrets.token_urlsafe(18) + "\n")  # never used (local trust), but initdb wants one
        self._hand_over(pwfile)
        # C.UTF-8 rather than the host's locale, so a test's ordering does not depend on what is installed.
        self._run([str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER, "--pwfile", str(pwfile),
                   "-E", "UTF8", "--locale=C.UTF-8", "--auth-local=trust", "--auth-host=scram-sha-256",
                   "--no-sync", "--no-instructions"], what="initdb")
        pwfile.unlink()

    def start(self, timeout: float = 30.0) -> None:
        self.socket_dir.mkdir(exist_ok=True)
        self._hand_over(self.socket_dir)
        settings = {**_SERVER_SETTINGS, "port": str(self.port), "unix_socket_directories": str(self.socket_dir)}
        args = [str(self.bin_dir / "postgres"), "-D", str(self.data_dir)]
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        # setpriv executes postgres in its own place: the pid is the server's.
        self.proc = subprocess.Popen(self._as_account(args), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self._env(), cwd=self.base_dir)
        log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        """Until the server accepts connections (listening is not enough: it answers "the database system is
        starting up" for a while)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode} on start:\n{self.log_tail()}")
            ready = subprocess.run([str(self.bin_dir / "pg_isready"), "-q", "-h", str(self.socket_dir), "-p",
                                    str(self.port), "-t", "1"], env=self._env(), check=False)
            if ready.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not accept connections on port {self.port} within {timeout}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    def create_app_role(self) -> None:
        # The password travels in a SQL literal over the local socket; token_urlsafe never needs quoting.
        self.psql(f"CREATE ROLE {APP_USER} LOGIN CREATEDB PASSWORD '{self.password}'")
        self.create_database(DEFAULT_DATABASE)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"

    def stop(self, timeout: float = 10.0) -> None:
        """Fast shutdown (disconnect clients, no checkpoint wait beyond the shutdown one); kill if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self._run([str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w",
                       "-t", str(int(timeout))], what="pg_ctl stop", timeout=timeout + 5)
            self.proc.wait(timeout=timeout)
        except (RuntimeError, subprocess.TimeoutExpired):
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def _hand_over(self, path: Path) -> None:
        if self.account is not None:
            os.chown(path, self.account.pw_uid, self.account.pw_gid)


def _check_identifier(name: str) -> None:
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"database name {name!r} is not a plain lower-case SQL identifier")


def start(workdir: Path | None = None) -> PostgresServer:
    """A fresh server on a free port with the application role and its database `trainyard`. The directory
    is on tmpfs unless `workdir` is given (which, when running as root, the `postgres` user must be able to
    reach). Stop it with `stop_and_clean`."""
    bin_dir = find_bin_dir()
    account = _service_account()
    base = Path(tempfile.mkdtemp(prefix="trainyard-pg-", dir=str(workdir) if workdir else _tmp_root()))
    server = PostgresServer(bin_dir=bin_dir, base_dir=base, host="127.0.0.1", port=free_port(),
                            password=secrets.token_urlsafe(18), account=account)
    try:
        server._hand_over(base)
        server.initdb()
        server.start()
        server.create_app_role()
    except BaseException:
        stop_and_clean(server)
        raise
    return server


def stop_and_clean(server: PostgresServer) -> None:
    server.stop()
    shutil.rmtree(server.base_dir, ignore_errors=True)
