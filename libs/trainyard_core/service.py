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
from .settings import BaseSettings, SettingsError, load_settings, redacted

S = TypeVar("S", bound=BaseSettings)
log = logging.getLogger(__name__)


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
    log.info("starting", extra={"settings": redacted(settings)})
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
    except (OSError, TrainyardError) as e:
        log.error("cannot start: %s", e)
        return 1
    log.info("stopped")
    return 0
