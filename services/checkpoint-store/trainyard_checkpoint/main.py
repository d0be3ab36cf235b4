"""`trainyard-checkpoint-store`: wiring only. Settings → CheckpointApp → ready file → wait for a signal."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from trainyard_core.service import run
from trainyard_core.settings import write_ready_file

from .app import CheckpointApp
from .settings import CheckpointSettings


async def serve(settings: CheckpointSettings, stop: asyncio.Event) -> None:
    app = CheckpointApp(settings)
    await app.start()
    try:
        write_ready_file(settings.ready_file, grpc_port=app.grpc_port)
        await stop.wait()
    finally:
        await app.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return run(service="checkpoint-store", settings_cls=CheckpointSettings,
               env_prefix="TRAINYARD_CHECKPOINT_STORE_", serve=serve, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
