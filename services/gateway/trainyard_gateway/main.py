"""`trainyard-gateway`: wiring only. Settings → GatewayApp → ready file → serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from trainyard_core import gc_tuning
from trainyard_core.service import run
from trainyard_core.settings import write_ready_file

from .app import GatewayApp
from .settings import GatewaySettings


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    gc_tuning.tune()
    app = GatewayApp(settings)
    # A start failure (e.g. etcd unreachable while storing the bootstrap token) is a TrainyardError or
    # OSError, which service.run reports as "cannot start" with exit code 1, without a traceback.
    await app.start()
    gc_tuning.freeze_startup_heap()
    try:
        write_ready_file(settings.ready_file, http_port=app.http_port, grpc_port=app.grpc_port)
        await stop.wait()
    finally:
        await app.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return run(service="gateway", settings_cls=GatewaySettings, env_prefix="TRAINYARD_GATEWAY_", serve=serve,
               argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
