"""`trainyard-agent`: wiring only. Settings → AgentApp → serve until SIGTERM/SIGINT → stop.

`trainyard-agent inject ...` and `trainyard-agent set-health ...` are operator commands against a running
agent (cli.py), not the daemon.

Exit codes: 0 stopped normally; 1 cannot start (no NVML without --gpu-profile, port in use, ...; the
log says why); 2 invalid settings, or settings this agent cannot keep teams apart with (no run_as and
no single_tenant, run_as without root, a workdir_root other users cannot reach: `tenancy.py`); 3 the
scheduler refused this node's registration (a configuration error: restarting will not help, e.g.
systemd's RestartPreventExitStatus=3).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from trainyard_core.service import run
from trainyard_core.settings import write_ready_file

from . import cli
from .app import AgentApp
from .settings import AgentSettings
from .tenancy import TenancyError

log = logging.getLogger(__name__)

EXIT_INVALID_SETTINGS = 2
EXIT_REFUSED = 3


async def serve(settings: AgentSettings, stop: asyncio.Event) -> None:
    app = AgentApp(settings)
    try:
        await app.start()
    except TenancyError as exc:
        # A configuration error, like invalid settings: restarting cannot fix it.
        print(f"error: {exc.message}", file=sys.stderr)
        log.error("cannot start: %s", exc.message)
        raise SystemExit(EXIT_INVALID_SETTINGS) from None
    assert app.reporter is not None
    write_ready_file(settings.ready_file, grpc_port=app.grpc_port)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(app.reporter.fatal_event.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await app.stop(kill_workers=settings.kill_workers_on_stop)
    if app.reporter.fatal is not None:
        log.error("agent stopped: %s", app.reporter.fatal.message)
        raise SystemExit(EXIT_REFUSED)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in cli.COMMANDS:
        return cli.main(args)
    return run(service="agent", settings_cls=AgentSettings, env_prefix="TRAINYARD_AGENT_", serve=serve, argv=args)


if __name__ == "__main__":
    raise SystemExit(main())
