"""Process entry helper shared by every service's main.py: settings → logging → telemetry → run until
SIGTERM/SIGINT → orderly shutdown. Bad settings end the process with exit code 2 and a clear message.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from . import telemetry
from .errors import TrainyardError
from .logs import setup_logging
from .security.tls import TlsConfigError
from .security.tls import load as load_tls
from .settings import BaseSettings, EtcdSettings, SettingsError, load_settings, redacted
from .store.etcd_options import file_problems

S = TypeVar("S", bound=BaseSettings)
log = logging.getLogger(__name__)


async def start_or_undo(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[object]]) -> None:
    """`start`, and when it fails part way, `stop` before the error goes up: a failed start leaves nothing
    running (no server listening, no watch or connection open). `stop` must cope with a partial start."""
    try:
        await start()
    except BaseException:
        await stop()
        raise


def check_transport(settings: BaseSettings) -> str:
    """Why the service must not start with these TLS settings ("" when it may): plaintext only when asked
    for explicitly, and a certificate that loads and names this service's principal."""
    files = settings.tls
    if files is None:
        if not settings.insecure_plaintext:
            return ("no mTLS certificate: set tls_cert_file, tls_key_file and tls_ca_file (`make run` keeps a "
                    "development PKI in .trainyard/pki/, `make certs` writes one for deploy/), or set "
                    "insecure_plaintext=true for a development setup without TLS")
        log.warning("PLAINTEXT gRPC: insecure_plaintext is set, so this service serves and calls without TLS "
                    "and without authorization; anyone who reaches its port may call every RPC")
        return ""
    try:
        material = load_tls(files)
    except TlsConfigError as exc:
        return f"tls_cert_file/tls_key_file/tls_ca_file: {exc}"
    expected = settings.principal()
    if expected is not None and material.principal != expected:
        return (f"tls_cert_file {files.cert} names {material.principal}, but this service is {expected}: give it "
                "its own certificate")
    log.info("mTLS on", extra={"principal": str(material.principal), "cert_file": str(files.cert)})
    return ""


def check_etcd(settings: BaseSettings) -> str:
    """Why the service must not start with these etcd settings ("" when it may): TLS files that load, and
    plaintext only when a setting asks for it (etcd_insecure_plaintext, or insecure_plaintext for a
    development setup without any TLS). Whether etcd takes the credential is checked once connected
    (`store.etcd_check.check_access`)."""
    if not isinstance(settings, EtcdSettings):
        return ""
    options = settings.etcd_options()
    if not options.tls:
        if not (settings.etcd_insecure_plaintext or settings.insecure_plaintext):
            return ("no TLS to etcd: set etcd_ca_file with etcd_cert_file/etcd_key_file (or etcd_user/"
                    "etcd_password) as docs/security.md (etcd) says, or set etcd_insecure_plaintext=true for a "
                    "development etcd without TLS")
        log.warning("PLAINTEXT etcd: %s is set, so this service talks to etcd without TLS; anyone on the path "
                    "reads and changes its state", "etcd_insecure_plaintext" if settings.etcd_insecure_plaintext
                    else "insecure_plaintext")
        return ""
    problem = file_problems(options)
    if not problem:
        log.info("etcd over TLS", extra=options.describe())
    return problem


def run(
    *,
    service: str,
    settings_cls: type[S],
    env_prefix: str,
    serve: Callable[[S, asyncio.Event], Awaitable[None]],
    argv: Sequence[str] | None = None,
) -> int:
    """Build settings and run `serve(settings, stop)`; `stop` is set by SIGTERM/SIGINT."""
    try:
        settings = load_settings(settings_cls, prog=f"trainyard-{service}", env_prefix=env_prefix,
                                 argv=sys.argv[1:] if argv is None else argv, env=dict(os.environ))
    except SettingsError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    setup_logging(service, settings.log_level, settings.log_format)
    # Tracing first, so that every line from here on names a trace (the process's, outside requests and jobs).
    telemetry.setup_tracing(service, settings, process=True)
    try:
        return _run(service, settings, serve)
    finally:
        telemetry.end_process()


def _run(service: str, settings: S, serve: Callable[[S, asyncio.Event], Awaitable[None]]) -> int:
    log.info("starting", extra={"settings": redacted(settings)})
    problem = check_transport(settings) or check_etcd(settings)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        log.error("cannot start: %s", problem)
        return 2
    telemetry.setup(service, settings)

    async def main() -> None:
        from .rpc.server import install_stop_signals

        stop = asyncio.Event()
        install_stop_signals(stop)
        await serve(settings, stop)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except SettingsError as e:  # found once connected, e.g. etcd refusing the credential (etcd_check)
        print(f"error: {e.message}", file=sys.stderr)
        log.error("cannot start: %s", e.message)
        return 2
    except (OSError, TrainyardError) as e:
        log.error("cannot start: %s", e)
        return 1
    log.info("stopped")
    return 0
